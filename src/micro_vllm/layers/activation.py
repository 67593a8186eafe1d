"""The gated activation of the MLPs: SiLU(gate) * up on one fused gate_up tensor.

CUDA tensors take one Triton launch (``triton_ops.silu_and_mul``); the PyTorch code is its slow twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from micro_vllm.fused import fused_ops


class SiluAndMul(nn.Module):
    """Takes [..., 2 * d] laid out as (gate, up) and returns [..., d]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if (ops := fused_ops(gate_up)) is not None:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
