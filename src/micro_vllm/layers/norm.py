"""RMSNorm, with the residual add fused in the way decoder layers use it.

CUDA tensors take one Triton launch (``triton_ops.rms_norm``); the PyTorch code below is its slow
twin, run everywhere else and tested against it.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from micro_vllm.fused import fused_ops


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    ``forward(x)`` returns the normalized ``x``. ``forward(x, residual)`` first adds ``residual`` to
    ``x`` and returns ``(normalized sum, sum)``: the sum is the next residual, so a decoder layer never
    keeps a separate add.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (ops := fused_ops(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even for bf16 inputs; the weight multiplies after the cast back, as in
        # Hugging Face's implementation, so low-precision outputs match it bit for bit.
        x_float = x.float()
        variance = x_float.pow(2).mean(dim=-1, keepdim=True)
        normalized = (x_float * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return self.weight * normalized

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
