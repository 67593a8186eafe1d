"""The gated activation of the MLPs: SiLU(gate) * up on one fused gate_up tensor.

A CustomOp: ``forward_triton`` is one Triton launch (``triton_ops.silu_and_mul``), ``forward_native``
the PyTorch code it is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from micro_vllm.layers.custom_op import CustomOp, triton_ops


class SiluAndMul(CustomOp):
    """Takes [..., 2 * d] laid out as (gate, up) and returns [..., d]."""

    name = "silu_and_mul"

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def forward_triton(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_ops.silu_and_mul(gate_up)
