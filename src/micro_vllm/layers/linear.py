"""Linear layers: ``Linear`` with a CPU path through oneDNN, and ``MergedLinear`` for projections the
checkpoint stores in pieces.

On CPU, fp32 matmuls at decode's small batches run faster from a weight oneDNN has laid out for them
once than through ``F.linear``'s BLAS call on the plain weight, so ``process_weights_after_loading``
(vLLM's name) swaps each ``Linear``'s weight for that layout after the checkpoint is in. Projections
that read the same input (q/k/v, gate/up) run as one matmul; the checkpoint keeps them as separate
tensors, so each piece is copied into its row range at load time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` whose matmul runs through oneDNN once ``use_onednn`` has repacked its weight.

    A single row (one decode) is a matrix-vector product bound by reading the weight; BLAS streams
    the transposed weight, [in, out], faster than either oneDNN's layout or the plain one, so the
    layer keeps that copy too (on CPU it holds its weight twice)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("transposed_weight", None, persistent=False)  # set by use_onednn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.weight.is_mkldnn:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1:
            if self.bias is None:
                return torch.mm(x, self.transposed_weight)
            return torch.addmm(self.bias, x, self.transposed_weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @torch.no_grad()
    def use_onednn(self) -> None:
        """Replace the plain weight by oneDNN's layout of it and its transpose (the plain one is freed
        unless shared)."""
        self.transposed_weight = self.weight.t().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        self.weight = nn.Parameter(packed, requires_grad=False)


def onednn_runs(weight: torch.Tensor) -> bool:
    """Whether oneDNN serves ``weight``'s matmuls: fp32 on a CPU build that has it (it would emulate
    bf16 on CPUs without bf16 instructions)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def process_weights_after_loading(model: nn.Module) -> None:
    """Lay out every ``Linear`` weight for oneDNN where it runs; a no-op on GPUs."""
    for module in model.modules():
        if isinstance(module, Linear) and onednn_runs(module.weight):
            module.use_onednn()


class MergedLinear(Linear):
    """``Linear`` whose output rows are the concatenation of several projections (``output_sizes``)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)

    @torch.no_grad()
    def load_shard(self, shard: int, param_name: str, loaded: torch.Tensor) -> None:
        """Copy projection number ``shard``'s ``weight`` or ``bias`` into its rows."""
        param = getattr(self, param_name)
        start = sum(self.output_sizes[:shard])
        rows = param[start : start + self.output_sizes[shard]]
        if rows.shape != loaded.shape:
            raise ValueError(
                f"shard {shard} of {param_name}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {tuple(rows.shape)}"
            )
        rows.copy_(loaded)
