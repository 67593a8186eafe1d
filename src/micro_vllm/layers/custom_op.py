"""Layer ops with two implementations, one chosen per op when the model is built (vLLM's CustomOp).

``forward_native`` is the PyTorch code: it runs on every device and is the ground truth the tests
hold the other to. ``forward_triton`` is a fused Triton kernel from ``triton_ops.py`` that does the
same work in one launch. ``ModelConfig.custom_ops`` says which ops take their kernel;
``resolve_custom_ops`` turns it into a set of op names once, for the engine's device, and
``set_custom_ops`` points each op's ``forward`` at its implementation, so no call decides anything.
A fused op (``FUSED_OPS``) does the work of several ops in one kernel; it takes that kernel only
where they all take theirs, so turning one of them off turns the fusion off too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from micro_vllm.config import CUSTOM_OPS
from micro_vllm.triton_utils import HAS_TRITON, check_triton_runs_on

if HAS_TRITON:
    from micro_vllm.layers import triton_ops  # what the layers' forward_triton call
else:  # no op is ever set to forward_triton then: resolve_custom_ops refuses to enable one
    triton_ops = None

# Each fused op's name -> the ops whose kernels its one kernel replaces.
FUSED_OPS = {"fused_qk_norm_rope": ("qk_norm", "rotary_embedding")}


class CustomOp(nn.Module):
    """An op whose ``forward`` is ``forward_native`` until ``set_custom_ops`` says otherwise."""

    name: str  # the op's name in ``custom_ops``

    def __init__(self) -> None:
        super().__init__()
        self.use_triton(False)

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_triton(self, *args, **kwargs):
        raise NotImplementedError

    def use_triton(self, enabled: bool) -> None:
        self._forward = self.forward_triton if enabled else self.forward_native


def resolve_custom_ops(custom_ops: Iterable[str] | None, device: torch.device) -> frozenset[str]:
    """The names of the ops that run their Triton kernel on ``device``, from a validated
    ``ModelConfig.custom_ops``; raises if any is enabled where Triton cannot run."""
    custom_ops = tuple(custom_ops or ())
    by_default = device.type == "cuda" and HAS_TRITON
    base = "all" in custom_ops or ("none" not in custom_ops and by_default)
    enabled = set(CUSTOM_OPS) if base else set()
    enabled |= {entry[1:] for entry in custom_ops if entry.startswith("+")}
    enabled -= {entry[1:] for entry in custom_ops if entry.startswith("-")}
    for fused, parts in FUSED_OPS.items():
        if not enabled.issuperset(parts):
            if f"+{fused}" in custom_ops:
                raise ValueError(
                    f"custom_ops={list(custom_ops)} enables {fused!r} without all of {list(parts)}, whose "
                    "kernels it replaces; enable those too"
                )
            enabled.discard(fused)
    if enabled:
        check_triton_runs_on(device, f"custom_ops={list(custom_ops)} (enabling {sorted(enabled)})")
    return frozenset(enabled)


def set_custom_ops(model: nn.Module, enabled: Collection[str]) -> None:
    """Point every CustomOp of ``model`` at its Triton kernel if its name is in ``enabled``, else at
    its PyTorch code."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.use_triton(module.name in enabled)
