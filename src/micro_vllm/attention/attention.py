"""The attention layer models use, and the per-step metadata the ModelRunner passes to it.

A layer owns no scheduling state: the runner binds its paged KV tensor once (``kv_cache``) and hands it
an ``AttentionMetadata`` on every forward, so there is no hidden global context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from micro_vllm.attention.operators.registry import get_backend
from micro_vllm.attention.spec import AttentionSpec


@dataclass
class AttentionMetadata:
    """One KV-cache group's view of one step; shared by every layer of that group.

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
    query_start_loc_cpu: torch.Tensor  # int32 copies on the host, for backends that loop in Python
    seq_lens_cpu: torch.Tensor
    # int32 [num_reqs], decode steps only: the order in which a backend may start the requests'
    # work (longest context first, so the long programs do not finish last); None: request order.
    decode_order: torch.Tensor | None = None
    # What a backend derives from the fields above for this step (gather indices, masks), built by
    # the group's first layer and reused by the others; keyed by the backend.
    backend_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]


class Attention(nn.Module):
    """Multi-head attention over the paged KV cache (GQA when ``num_kv_heads < num_heads``).

    Inputs are flat over the step's tokens: ``query`` is [T, num_heads * head_size], ``key`` and
    ``value`` are [T, num_kv_heads * head_size]. The layer writes this step's K/V into its cache
    through ``slot_mapping``, then attends over the whole context read through the block table.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        backend: str,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = get_backend(backend)
        # [2, num_blocks, block_size, num_kv_heads, head_size]; bound by the ModelRunner.
        self.kv_cache = torch.empty(0)

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_size, self.sliding_window)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        output = self.backend.write_and_attend(
            query, key, value, self.kv_cache, metadata, scale=self.scale, sliding_window=self.sliding_window
        )
        return output.view(num_tokens, self.num_heads * self.head_size)
