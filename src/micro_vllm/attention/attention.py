"""The attention layer models use: projections in, paged attention through the model's backend, out.

A layer owns no scheduling state: the ModelRunner binds the model's one backend and the layer's paged KV
tensor once and hands it an ``AttentionMetadata`` on every forward, so there is no hidden global context.
"""

from __future__ import annotations

import torch
from torch import nn

from micro_vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from micro_vllm.attention.spec import AttentionSpec


class Attention(nn.Module):
    """Multi-head attention over the paged KV cache (GQA when ``num_kv_heads < num_heads``).

    Inputs are flat over the step's tokens: ``query`` is [T, num_heads * head_size], ``key`` and
    ``value`` are [T, num_kv_heads * head_size]. The layer writes this step's K/V into its cache
    through the slot mapping, then attends over the whole context read through the block table.
    """

    def __init__(
        self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        # Bound by the ModelRunner: the backend, shared by every layer of the model, and this layer's
        # cache, [2, num_blocks, block_size, num_kv_heads, head_size].
        self.backend: AttentionBackend | None = None
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
