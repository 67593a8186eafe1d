"""How a checkpoint tensor reaches a parameter: whole, or the slice of it one tensor-parallel rank holds.

Every parameter of a parallel layer carries a ``weight_loader(param, loaded_weight, shard_id=None)``
(vLLM's convention) that copies its part of a checkpoint tensor in. ``loaded_weight`` is a torch
tensor or a safetensors slice (``safe_open(...).get_slice(name)``): both index with slices, and a
slice reads from the file only the bytes it is indexed for, so a rank that holds a quarter of a
layer reads a quarter of its weight, and a model larger than one device loads.

The loaders hold numbers only, never their module: a loader bound to its layer would make a reference
cycle that, under the engine's frozen heap, would keep the model alive after the engine is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

# What a shard_id names: the checkpoint tensor that fills part of a fused parameter (an index of a
# merged layer's outputs, "q"/"k"/"v"), or None for a tensor that fills the whole parameter.
ShardId = Union[int, str, None]
CheckpointTensor = Any  # a torch.Tensor or a safetensors slice


def checkpoint_shape(loaded_weight: CheckpointTensor) -> tuple[int, ...]:
    if isinstance(loaded_weight, torch.Tensor):
        return tuple(loaded_weight.shape)
    return tuple(loaded_weight.get_shape())


def narrow_weight(loaded_weight: CheckpointTensor, dim: int, start: int, size: int) -> torch.Tensor:
    """Entries ``start .. start + size - 1`` along ``dim`` (fewer where the tensor ends first); from
    a safetensors slice only these are read."""
    return loaded_weight[(slice(None),) * dim + (slice(start, start + size),)]


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: ShardId = None) -> None:
    """The whole checkpoint tensor into ``param``: a parameter every rank holds whole."""
    if shard_id is not None:
        raise ValueError(f"shard_id={shard_id!r}: this parameter is loaded from one whole tensor (shard_id None)")
    copy_weight(param.data, loaded_weight[:])


@dataclass(frozen=True)
class Shard:
    """The part of one checkpoint tensor a rank holds: ``size`` entries from ``start`` along the
    split dimension of a tensor with ``total`` there, copied into the parameter from ``offset``."""

    offset: int
    start: int
    size: int
    total: int


@dataclass(frozen=True)
class ShardedWeightLoader:
    """The ``weight_loader`` of a parameter split over the ranks along ``dim``; ``shards`` says what
    this rank takes from each checkpoint tensor that fills it. Where the checkpoint ends inside the
    rank's rows (a vocabulary padded to a multiple of the ranks), the rows past it stay as they are."""

    dim: int
    shards: Mapping[ShardId, Shard]

    def __call__(self, param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: ShardId = None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"shard_id={shard_id!r} is not one of this parameter's {list(self.shards)}")
        shard = self.shards[shard_id]
        shape, expected = checkpoint_shape(loaded_weight), list(param.shape)
        expected[self.dim] = shard.total
        if shape != tuple(expected):
            raise ValueError(f"checkpoint shape {shape}, expected {tuple(expected)}")
        piece = narrow_weight(loaded_weight, self.dim, shard.start, shard.size)
        copy_weight(param.data.narrow(self.dim, shard.offset, piece.shape[self.dim]), piece)
