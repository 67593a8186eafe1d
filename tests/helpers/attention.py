"""Random paged attention batches for testing a backend against ``reference``: shuffled pages,
decodes mixed with prefill chunks, sliding windows with their earlier pages unmapped, and a cache
poisoned with NaN wherever no request's context lies, so that a stray read shows up as NaN."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from micro_vllm.attention.backends.abstract import AttentionMetadata, AttentionMetadataBuilder, CommonAttentionMetadata
from micro_vllm.attention.spec import AttentionSpec

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@dataclass
class Batch:
    query: torch.Tensor  # [num_actual + padding, H, D]
    kv_cache: torch.Tensor  # poisoned where nothing may be read
    clean_cache: torch.Tensor  # same data without poison, for the reference
    metadata: AttentionMetadata  # the common metadata alone, as the reference backend reads it

    def built_by(self, builder_cls: type[AttentionMetadataBuilder], sliding_window: int | None) -> AttentionMetadata:
        """The step's metadata as ``builder_cls`` builds it for a KV cache group of these layers with
        ``sliding_window``."""
        _, _, block_size, num_kv_heads, head_size = self.kv_cache.shape
        common = self.metadata.common
        builder = builder_cls(AttentionSpec(num_kv_heads, head_size, sliding_window), self.query.shape[1], block_size,
                              common.num_reqs, self.query.device, self.kv_cache.dtype, self.query.dtype)
        return builder.build(common)


def make_batch(
    rng: random.Random,
    requests: list[tuple[int, int]],  # (query_len, context_len before the queries)
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    num_pad_tokens: int = 0,
    device: str = DEVICE,
    kv_cache_dtype: torch.dtype | None = None,  # None: the query's dtype
) -> Batch:
    seq_lens = [q + c for q, c in requests]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_needed) + 1  # one spare column, pointing at the null block
    pool = list(range(1, sum(blocks_needed) + 4))  # block 0 is the null block
    rng.shuffle(pool)  # non-contiguous, out-of-order pages

    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    cache = torch.randn(2, len(pool) + 1, block_size, num_kv_heads, head_size, dtype=torch.float32)
    cache = cache.to(kv_cache_dtype or dtype)
    poisoned = cache.clone()
    poisoned[:, 0] = float("nan")
    for i, ((query_len, context_len), seq_len) in enumerate(zip(requests, seq_lens)):
        pages = [pool.pop() for _ in range(blocks_needed[i])]
        # Pages every query of this request has left behind are unmapped (null), like a windowed
        # KV manager frees them.
        first_visible = context_len - sliding_window + 1 if sliding_window else 0
        for b, page in enumerate(pages):
            block_table[i, b] = 0 if (b + 1) * block_size <= first_visible else page
        if pages:
            poisoned[:, pages[-1], seq_len - (len(pages) - 1) * block_size :] = float("nan")

    query_lens = [q for q, _ in requests]
    num_actual = sum(query_lens)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    slots = []
    for i, (query_len, context_len) in enumerate(requests):
        for pos in range(context_len, context_len + query_len):
            slots.append(int(block_table[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1] * num_pad_tokens, dtype=torch.int64)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        num_actual_tokens=num_actual,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    query = torch.randn(num_actual + num_pad_tokens, num_heads, head_size).to(dtype)
    return Batch(query.to(device), poisoned.to(device), cache.to(device), AttentionMetadata(common))


def random_requests(
    rng: random.Random, num_decodes: int, num_chunks: int, max_context: int, max_chunk: int
) -> list[tuple[int, int]]:
    """Decodes (1 query) and prefill chunks (with or without cached context), shuffled together."""
    requests = [(1, rng.randint(0, max_context)) for _ in range(num_decodes)]
    for _ in range(num_chunks):
        requests.append((rng.randint(2, max_chunk), rng.choice([0, rng.randint(1, max_context)])))
    rng.shuffle(requests)
    return requests
