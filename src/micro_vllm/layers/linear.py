"""Linear layers whose weights the checkpoint stores in pieces.

Projections that read the same input (q/k/v, gate/up) run as one matmul; the checkpoint keeps them
as separate tensors, so each piece is copied into its row range at load time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """``nn.Linear`` whose output rows are the concatenation of several projections (``output_sizes``)."""

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
