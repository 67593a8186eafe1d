"""The one switch between the layers' PyTorch code and the fused Triton ops (``triton_ops``).

CUDA tensors take the fused ops when Triton is installed; everything else runs the PyTorch code,
which the fused ops are tested against. Setting ``triton_ops`` to None here turns them off for
every layer at once (the benchmark's same-run "before").
"""

from __future__ import annotations

from types import ModuleType

import torch

try:
    from micro_vllm.layers import triton_ops
except ImportError:  # Triton is optional: without it CUDA runs the PyTorch code too
    triton_ops = None


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The fused-op module for ``x``, or None when ``x`` takes the PyTorch code."""
    return triton_ops if x.is_cuda else None
