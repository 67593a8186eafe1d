"""The attention backend interface: the metadata the runner computes for every backend, the metadata
builder through which each backend derives its own from it, and the backend's entry points.

The runner computes a ``CommonAttentionMetadata`` per KV cache group and step; the group's
``AttentionMetadataBuilder`` turns it into the backend's ``AttentionMetadata`` once, and every layer
of the group reads that. A backend needing more than the common fields (kernel tiles, an order of
the requests, gather indices) subclasses both: its builder checks the group's layers and derives what
no step changes once, when it is made with the KV cache, and computes the rest once per step, so a
layer's call decides nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from micro_vllm.attention.spec import AttentionSpec


@dataclass
class CommonAttentionMetadata:
    """One KV cache group's view of one step, the same for every backend.

    Requests are laid out back to back: request ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i + 1]``, which sit at the last positions of its
    ``seq_lens[i]`` tokens of context (cached context first, then this step's tokens).
    """

    num_actual_tokens: int  # real tokens this step; inputs may be padded beyond it (CUDA graphs)
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on the device
    seq_lens: torch.Tensor  # int32 [num_reqs], on the device
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], on the device
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset; -1 = padding
    query_start_loc_cpu: torch.Tensor  # int32 copies on the host, for work planned in Python
    seq_lens_cpu: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]


@dataclass
class AttentionMetadata:
    """What a backend's metadata builder returns for one KV cache group and step: the common
    metadata, and in a backend's subclass the fields that backend derives from it."""

    common: CommonAttentionMetadata


class AttentionMetadataBuilder:
    """Builds a backend's metadata for one KV cache group, once per step (vLLM's name). This base
    class serves backends that read only the common metadata.

    ``spec``, ``num_heads``, ``kv_cache_dtype`` and ``dtype`` (the model's: the queries' and the step's
    K/V rows') describe the group's layers, checked here once; a
    builder that stages tensors of its own allocates them here, for at most ``max_num_reqs``
    requests, at addresses that never change (a captured CUDA graph reads them)."""

    def __init__(self, spec: AttentionSpec, num_heads: int, block_size: int, max_num_reqs: int,
                 device: torch.device, kv_cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
        if num_heads % spec.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}: "
                             "each KV head must serve the same number of query heads")
        self.spec = spec
        self.num_heads = num_heads
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = dtype

    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common)


class AttentionBackend(ABC):
    """Paged attention: write a step's K/V into the cache, then attend over the cached context.

    ``kv_cache`` is [2, num_blocks, block_size, num_kv_heads, head_size] (keys, then values), in the
    model's dtype or in float8 e4m3 (``kv_cache_dtype="fp8"``): a backend stores K/V as
    ``to_cache_dtype`` converts them and reads them back widened.
    ``forward`` takes ``query`` [T, num_heads, head_size] and returns the same shape; rows past
    ``metadata.common.num_actual_tokens`` (padding) may hold anything. A model holds one instance,
    shared by its layers; the metadata comes from the backend's ``builder_cls``.
    """

    builder_cls: type[AttentionMetadataBuilder] = AttentionMetadataBuilder
    # True when forward reads per-step sizes only from device tensors, so a CUDA graph captured for
    # one decode batch replays correctly for any context lengths.
    cuda_graph_safe: bool = False
    # Steps whose longest query has at least this many tokens take other kernel tiles (None: the
    # kernels do not change with it). A CUDA graph bakes in the tiles of the query bound it was
    # captured with, so mixed-step graphs are captured on both sides of it (worker/cuda_graphs.py).
    long_query_len: int | None = None

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Whether this backend serves attention heads of ``head_size`` channels (as vLLM's backends
        say which head sizes they take); the worker checks it once, at start-up."""
        return True

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...

    def write_and_attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """What a layer runs each step (vLLM's ``AttentionImpl.forward``): the step's K/V into the
        cache, then attention. A backend that can do both in fewer launches overrides it."""
        self.write_kv(key, value, kv_cache, metadata.common.slot_mapping)
        return self.forward(query, kv_cache, metadata, scale=scale, sliding_window=sliding_window)


def to_cache_dtype(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V as a cache of ``cache_dtype`` stores them. An fp8 cache keeps no scaling factor (as vLLM
    without calibrated scales): values saturate at its largest finite one, where a plain conversion
    would make NaN of them."""
    if cache_dtype.itemsize == 1:
        limit = torch.finfo(cache_dtype).max
        values = values.float().clamp(-limit, limit)
    return values.to(cache_dtype)
