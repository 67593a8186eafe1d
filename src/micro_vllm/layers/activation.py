"""The gated activation of the MLPs: SiLU(gate) * up on one fused gate_up tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """Takes [..., 2 * d] laid out as (gate, up) and returns [..., d]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
