"""Qwen3's per-head q/k RMSNorm followed by RoPE, as one op (vLLM's ``fused_qk_norm_rope``).

The two ops run back to back in every layer of a model with q/k norm, each one pass over q and k.
``forward_triton`` does both in one Triton launch (``triton_ops.fused_qk_norm_rope``), reading q and
k once and writing them once; ``forward_native`` runs the two ops one after the other, each by its
own route.
"""

from __future__ import annotations

import torch

from micro_vllm.layers.custom_op import CustomOp, triton_ops
from micro_vllm.layers.norm import QKNorm
from micro_vllm.layers.rotary import RotaryEmbedding


class QKNormRoPE(CustomOp):
    """``rotary_emb(positions, *qk_norm(q, k))`` for flat q [T, H * D] and k [T, Hkv * D], returning
    new tensors of the same shapes: an attention layer with q/k norm calls it where others call
    ``RotaryEmbedding``, with the same arguments.

    ``resolve_custom_ops`` enables this op's kernel only together with both ops it fuses, so turning
    either of them off (or this op alone) leaves the two ops to their own routes: with
    ``custom_ops=["none"]`` that is their PyTorch code. Both are this op's submodules, so
    ``set_custom_ops`` reaches them through it; neither holds a parameter of its own.
    """

    name = "fused_qk_norm_rope"

    def __init__(self, qk_norm: QKNorm, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.qk_norm = qk_norm
        self.rotary_emb = rotary_emb

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(positions, *self.qk_norm(query, key))

    def forward_triton(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_emb = self.rotary_emb
        return triton_ops.fused_qk_norm_rope(
            positions, query, key, *self.qk_norm.kernel_norms, rotary_emb.cos_sin_cache, rotary_emb.head_size
        )
