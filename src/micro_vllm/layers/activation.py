"""The gated activation of the MLPs: SiLU(gate) * up on one fused gate_up tensor.

CUDA tensors take one Triton launch (``triton_ops.silu_and_mul``); the PyTorch code is its slow twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    from micro_vllm.layers import triton_ops
except ImportError:  # Triton is optional: without it CUDA runs the PyTorch code too
    triton_ops = None


class SiluAndMul(nn.Module):
    """Takes [..., 2 * d] laid out as (gate, up) and returns [..., d]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if triton_ops is not None and gate_up.is_cuda:
            return triton_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
