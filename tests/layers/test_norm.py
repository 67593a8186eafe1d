"""RMSNorm's PyTorch path against transformers' LlamaRMSNorm: bit for bit in fp32, where it runs the
same steps with the small [tokens, 1] statistics updated in place."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from micro_vllm.layers.norm import RMSNorm


@pytest.mark.parametrize("tokens, hidden", [(1, 576), (64, 576), (300, 960), (7, 64)])
def test_fp32_rms_norm_rounds_as_transformers(tokens: int, hidden: int) -> None:
    ours, theirs = RMSNorm(hidden, eps=1e-5), LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(hidden))
        ours.weight.copy_(theirs.weight)
    x, residual = 4 * torch.randn(2, tokens, hidden)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        out, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(out, theirs(x + residual))
        # Per-head norms (Qwen3's q/k norm) read strided column slices of a fused projection.
        heads = torch.randn(tokens, 3 * hidden)[:, hidden:2 * hidden].unflatten(-1, (-1, 64))
        per_head_ours, per_head_theirs = RMSNorm(64, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
        per_head_theirs.weight.copy_(torch.randn(64))
        per_head_ours.weight.copy_(per_head_theirs.weight)
        assert torch.equal(per_head_ours(heads), per_head_theirs(heads))
