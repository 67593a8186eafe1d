"""RMSNorm, with the residual add fused in the way decoder layers use it, and Qwen3's per-head
RMSNorm of queries and keys.

Both are CustomOps: ``forward_triton`` is one Triton launch (``triton_ops.rms_norm``,
``triton_ops.qk_norm``), ``forward_native`` the PyTorch code it is tested against.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from micro_vllm.layers.custom_op import CustomOp, triton_ops


class RMSNorm(CustomOp):
    """Root-mean-square norm over the last dimension.

    ``forward(x)`` returns the normalized ``x``. ``forward(x, residual)`` first adds ``residual`` to
    ``x`` and returns ``(normalized sum, sum)``: the sum is the next residual, so a decoder layer never
    keeps a separate add.
    """

    name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward_native(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward_native(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return triton_ops.rms_norm(x, self.weight, self.eps, residual)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even for bf16 inputs; the weight multiplies after the cast back, as in
        # Hugging Face's implementation, so low-precision outputs match it bit for bit. (PyTorch's
        # F.rms_norm runs these same steps on CPU, through more dispatch.)
        x_float = x.float()
        variance = x_float.pow(2).mean(dim=-1, keepdim=True)
        normalized = (x_float * variance.add_(self.eps).rsqrt_()).to(x.dtype)
        return self.weight * normalized

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class QKNorm(CustomOp):
    """RMSNorm of each query head and each key head of flat q [T, H * D] and k [T, Hkv * D] (Qwen3,
    before RoPE), returning new tensors of the same shapes.

    The weights belong to the attention layer's ``q_norm`` and ``k_norm`` (the checkpoint's names for
    them); this op keeps those two modules in a tuple, which registers neither a second time.
    """

    name = "qk_norm"

    def __init__(self, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        super().__init__()
        self.norms = (q_norm, k_norm)
        self.head_size = q_norm.weight.shape[0]

    def forward_native(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(
            norm.forward_native(x.unflatten(-1, (-1, self.head_size))).flatten(-2)
            for norm, x in zip(self.norms, (query, key))
        )

    def forward_triton(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_ops.qk_norm(query, key, *self.kernel_norms, self.head_size)

    @property
    def kernel_norms(self) -> tuple[tuple[torch.Tensor, float], ...]:
        """``(weight, eps)`` of the query's norm and of the key's, as the Triton kernels take them."""
        return tuple((norm.weight, norm.eps) for norm in self.norms)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}"
