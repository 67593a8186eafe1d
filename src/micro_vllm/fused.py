"""The one switch between PyTorch code and the Triton kernels that replace it on CUDA.

Two kernel modules: the layers' fused elementwise ops (``layers/triton_ops.py``) and the sampler
(``sampling/triton_sampler.py``). CUDA tensors take them when Triton is installed;
everything else runs the PyTorch code they are tested against. Setting a module to None here turns
it off everywhere at once (the benchmark's same-run "before").
"""

from __future__ import annotations

from types import ModuleType

import torch

try:
    from micro_vllm.layers import triton_ops
    from micro_vllm.sampling import triton_sampler
except ImportError:  # Triton is optional: without it CUDA runs the PyTorch code too
    triton_ops = triton_sampler = None


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The fused-op module for ``x``, or None when ``x`` takes the layers' PyTorch code."""
    return triton_ops if x.is_cuda else None


def fused_sampler(device: torch.device) -> ModuleType | None:
    """The Triton sampler for logits on ``device``, or None when they take the PyTorch sampler."""
    return triton_sampler if device.type == "cuda" else None
