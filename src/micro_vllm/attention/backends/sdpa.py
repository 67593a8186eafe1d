"""PyTorch's scaled_dot_product_attention over the whole step in one call per layer and batch.

A step's requests form two padded batches: its decodes (one query each) and its prefill chunks (padded
to the longest chunk), so a step that mixes both does not pad every decode to a chunk's length. For
each batch, the positions every layer reads (the flat cache slot of each request's keys, the query
rows, the causal and sliding-window mask) are computed once per step by the KV cache group's metadata
builder and read by the group's layers; a layer then runs one gather of its K/V and one attention call
per batch, with no per-request Python. The gather lays K/V out head by head, [requests, KV heads,
keys, head size], so each (request, KV head) is one contiguous matrix: decodes (one query per request,
a group of query heads per KV head) score their keys in one batched matmul, which on CPU costs less
than ``scaled_dot_product_attention``'s blocked kernel at a few queries per head. In fp32, a decode's
values are not gathered at all: ``embedding_bag`` sums each query head's value rows, weighted by its
probabilities, where they lie in the cache; on CPU its keys are not either: ``sampled_addmm`` takes
just the dot products of each query head with its key rows, in place. The slots the step's K/V are
written to are likewise sorted out once per step (``KVWrites``), so a layer's write is one copy per
cache tensor.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from micro_vllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    to_cache_dtype,
)


@dataclass
class PaddedBatch:
    """Some of a step's requests as rows of ``num_queries`` query slots over ``num_keys`` key slots.

    A request's key slots start at the first key its queries may see (the window's start), so a
    sliding window bounds ``num_keys`` whatever the context length.
    """

    num_queries: int
    num_keys: int
    query_rows: torch.Tensor  # int64 [R * num_queries]: each query slot's token row (padding: a valid row)
    # int64 [R * kv_heads * num_keys]: each (request, KV head, key slot)'s row in the cache seen as
    # [slots * kv_heads, head_size]
    kv_rows: torch.Tensor
    group: int  # query heads per KV head
    # Prefill chunks: bool [R, 1, group * num_queries, num_keys], True where a query slot sees a key
    # slot. Decodes: float [R * kv_heads, 1, num_keys], 0 where the query sees the key and -inf
    # elsewhere (added to the scores). None where every query slot sees every key slot.
    mask: torch.Tensor | None
    real_slots: torch.Tensor  # int64 [tokens of these requests]: the query slots holding real tokens
    token_rows: torch.Tensor  # int64 [tokens of these requests]: their token rows, in the same order

    @cached_property
    def value_bags(self) -> torch.Tensor:
        """Decodes: int64 [R * heads, num_keys], each query head's value rows (its KV head's
        ``kv_rows``; query head h reads KV head h // group), the bags ``embedding_bag`` sums. Built by
        the first layer that reads it: only fp32 caches do."""
        return self.kv_rows.view(-1, 1, self.num_keys).expand(-1, self.group, -1).reshape(-1, self.num_keys)

    @cached_property
    def score_pattern(self) -> torch.Tensor:
        """Decodes: sparse CSR [R * heads, cache rows up to the last one read], an entry at each query
        head's ``value_bags``, for ``sampled_addmm`` to compute just those dot products. Built by the
        first layer that reads it: only fp32 caches on CPU do."""
        bags = self.value_bags
        num_rows, num_keys = bags.shape
        row_starts = torch.arange(0, num_rows * num_keys + 1, num_keys, device=bags.device)
        zeros = torch.zeros(bags.numel(), device=bags.device)
        size = (num_rows, int(self.kv_rows.max()) + 1)
        with warnings.catch_warnings():  # torch warns that its CSR support is in beta
            warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
            return torch.sparse_csr_tensor(row_starts, bags.flatten(), zeros, size=size, check_invariants=False)


def padded_batch(metadata: CommonAttentionMetadata, requests_cpu: torch.Tensor, block_size: int,
                 sliding_window: int | None, num_kv_heads: int, group: int) -> PaddedBatch:
    """The padded layout of ``requests_cpu`` (indices into the step's requests), for layers with
    ``num_kv_heads`` KV heads and ``group`` query heads per KV head."""
    device = metadata.seq_lens.device
    requests = requests_cpu.to(device)
    starts_cpu = metadata.query_start_loc_cpu.long()
    query_lens_cpu = starts_cpu[requests_cpu + 1] - starts_cpu[requests_cpu]
    seq_lens_cpu = metadata.seq_lens_cpu[requests_cpu].long()
    num_queries = int(query_lens_cpu.max())
    first_key_cpu = _first_visible_key(seq_lens_cpu, query_lens_cpu, sliding_window)
    num_keys = int((seq_lens_cpu - first_key_cpu).max())

    query_start = metadata.query_start_loc[requests].long()[:, None]
    query_lens = query_lens_cpu.to(device)[:, None]
    seq_lens = seq_lens_cpu.to(device)[:, None]
    first_key = first_key_cpu.to(device)[:, None]
    query_offset = torch.arange(num_queries, device=device)[None, :]
    is_real = query_offset < query_lens  # [R, Q]
    query_rows = query_start + torch.minimum(query_offset, query_lens - 1)
    query_pos = seq_lens - query_lens + query_offset  # [R, Q]

    key_pos = first_key + torch.arange(num_keys, device=device)[None, :]  # [R, K]
    in_context = key_pos < seq_lens
    # Padding key slots read the request's last key: never a slot outside its context, whose
    # contents (even NaN) would reach the output through the masked scores.
    read_pos = torch.minimum(key_pos, seq_lens - 1)
    blocks = metadata.block_table[requests].long().gather(1, read_pos // block_size)
    kv_slots = blocks * block_size + read_pos % block_size
    heads = torch.arange(num_kv_heads, device=device)[None, :, None]
    kv_rows = (kv_slots[:, None, :] * num_kv_heads + heads).flatten()  # [R, kv_heads, K]

    mask = (key_pos[:, None, :] <= query_pos[:, :, None]) & in_context[:, None, :]
    if sliding_window is not None:
        mask &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window
    num_reqs = len(requests_cpu)
    if bool(mask.all()):
        mask = None
    elif num_queries == 1:  # one score row per (request, KV head): the batched matmuls' layout
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill_(~mask, float("-inf"))
        mask = bias.repeat_interleave(num_kv_heads, dim=0)
    else:  # as the queries are laid out: each KV head's query heads one after another
        mask = mask[:, None].expand(-1, group, -1, -1).reshape(num_reqs, group * num_queries, num_keys)[:, None]
    real_slots = is_real.flatten().nonzero().squeeze(1)
    return PaddedBatch(num_queries, num_keys, query_rows.flatten(), kv_rows, group, mask, real_slots,
                       query_rows.flatten()[real_slots])


def _first_visible_key(seq_lens: torch.Tensor, query_lens: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """The first position a request's first query may see: 0, or its window's start."""
    if sliding_window is None:
        return torch.zeros_like(seq_lens)
    return (seq_lens - query_lens - sliding_window + 1).clamp(min=0)


@dataclass
class KVWrites:
    """Where a step's K/V go: the cache slots, and the token rows that fill them (None: every row,
    in order; rows of padding tokens, slot -1, are left out)."""

    slots: torch.Tensor  # int64
    rows: torch.Tensor | None  # int64

    @classmethod
    def of(cls, slot_mapping: torch.Tensor) -> KVWrites:
        valid = slot_mapping >= 0
        if bool(valid.all()):
            return cls(slot_mapping, None)
        rows = valid.nonzero().squeeze(1)
        return cls(slot_mapping[rows], rows)

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if self.rows is not None:
            key, value = key[self.rows], value[self.rows]
        key, value = to_cache_dtype(key, kv_cache.dtype), to_cache_dtype(value, kv_cache.dtype)
        if kv_cache.dtype.itemsize == 1:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            kv_cache, key, value = kv_cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
        keys, values = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        keys.index_copy_(0, self.slots, key)
        values.index_copy_(0, self.slots, value)


@dataclass
class SdpaMetadata(AttentionMetadata):
    batches: list[PaddedBatch]  # the step's decodes and its prefill chunks, those it has
    kv_writes: KVWrites
    # Only decodes, their token rows the step's rows in order (no padding): the query is the batch as
    # it stands and the output needs no scatter.
    decodes_only: bool
    # How decodes read the cache, the builder's choice for the engine's life: the value rows summed
    # where they lie (embedding_bag), and the key rows scored where they lie (sampled_addmm).
    values_in_place: bool
    scores_in_place: bool


class SdpaMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # embedding_bag weights rows in the table's dtype, so only an fp32 cache (an fp32 model's) is
        # read in place; sampled_addmm's in-place scores pay on CPU only.
        self.values_in_place = self.kv_cache_dtype == torch.float32
        self.scores_in_place = self.values_in_place and self.device.type == "cpu"

    def build(self, common: CommonAttentionMetadata) -> SdpaMetadata:
        starts = common.query_start_loc_cpu.long()
        query_lens = starts[1:] - starts[:-1]
        group = self.num_heads // self.spec.num_kv_heads  # query heads per KV head
        batches = [padded_batch(common, selected.nonzero().squeeze(1), self.block_size, self.spec.sliding_window,
                                self.spec.num_kv_heads, group)
                   for selected in (query_lens == 1, query_lens > 1) if selected.any()]
        decodes_only = bool((query_lens == 1).all()) and common.slot_mapping.shape[0] == common.num_reqs
        return SdpaMetadata(common, batches, KVWrites.of(common.slot_mapping), decodes_only, self.values_in_place,
                            self.scores_in_place)


class SdpaBackend(AttentionBackend):
    builder_cls = SdpaMetadataBuilder

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        KVWrites.of(slot_mapping).write(key, value, kv_cache)

    def write_and_attend(self, query, key, value, kv_cache, metadata: SdpaMetadata, *, scale, sliding_window):
        # The slots to write were sorted out once for the step, not once per layer.
        metadata.kv_writes.write(key, value, kv_cache)
        return self.forward(query, kv_cache, metadata, scale=scale, sliding_window=sliding_window)

    def forward(self, query, kv_cache, metadata: SdpaMetadata, *, scale, sliding_window):
        keys, values = kv_cache.view(2, -1, kv_cache.shape[-1])  # one row per (slot, KV head)
        if metadata.decodes_only:
            return _attend(query, keys, values, metadata.batches[0], scale, metadata)
        output = torch.empty_like(query)
        for batch in metadata.batches:
            out = _attend(query.index_select(0, batch.query_rows), keys, values, batch, scale, metadata)
            output.index_copy_(0, batch.token_rows, out.index_select(0, batch.real_slots))
        return output


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: PaddedBatch,
            scale: float, metadata: SdpaMetadata) -> torch.Tensor:
    """One attention call over ``batch``, its query slots' rows given in ``query`` [R * num_queries,
    heads, d]; returns the output in the same layout. ``keys`` and ``values`` are the cache's rows,
    [slots * kv_heads, d]."""
    num_heads, head_size = query.shape[1:]
    q_len, k_len = batch.num_queries, batch.num_keys
    num_reqs = query.shape[0] // q_len
    if q_len == 1:
        scores = _decode_scores(query, keys, batch, scale, metadata.scores_in_place)
        if batch.mask is not None:
            scores += batch.mask
        out = _weighted_values(scores.softmax(dim=-1), values, batch, metadata.values_in_place)
        return out.to(query.dtype).view(num_reqs, num_heads, head_size)
    group = batch.group
    num_kv_heads = num_heads // group
    k = keys.index_select(0, batch.kv_rows).view(num_reqs, num_kv_heads, k_len, head_size)
    v = values.index_select(0, batch.kv_rows).view(num_reqs, num_kv_heads, k_len, head_size)
    k, v = k.to(query.dtype), v.to(query.dtype)  # an fp8 cache widens to the query's dtype; else a no-op
    # Each KV head's query heads stacked along the query axis, so one call serves GQA without
    # repeating K/V: [R, kv_heads, group * q_len, d].
    q = query.view(num_reqs, q_len, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group * q_len, head_size)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale)
    out = out.view(num_reqs, num_kv_heads, group, q_len, head_size).permute(0, 3, 1, 2, 4)
    return out.reshape(num_reqs * q_len, num_heads, head_size)


def _decode_scores(query: torch.Tensor, keys: torch.Tensor, batch: PaddedBatch, scale: float,
                   in_place: bool) -> torch.Tensor:
    """Each decode query head's scaled scores over its key slots, in fp32 whatever the model's dtype
    (as the reference backend): [R * kv_heads, group, num_keys], query head h of a request reading KV
    head h // group, so each (request, KV head) holds ``group`` rows."""
    head_size = query.shape[-1]
    if in_place:
        # sampled_addmm takes each dot product of a query row with a cache row where that row lies, so
        # K is never gathered into a copy, and runs no matrix call per (request, KV head), whose fixed
        # cost on CPU is most of a batched matmul's at a few query rows each.
        pattern = batch.score_pattern
        scores = torch.sparse.sampled_addmm(pattern, query.reshape(-1, head_size), keys[: pattern.shape[1]].t(),
                                            beta=0.0, alpha=scale)
        return scores.values().view(-1, batch.group, batch.num_keys)
    k = keys.index_select(0, batch.kv_rows).view(-1, batch.num_keys, head_size)
    q = query.reshape(k.shape[0], batch.group, head_size)
    return torch.bmm(q.float(), k.float().transpose(1, 2)).mul_(scale)


def _weighted_values(probs: torch.Tensor, values: torch.Tensor, batch: PaddedBatch, in_place: bool) -> torch.Tensor:
    """Each decode query head's probability-weighted sum of its value rows, in fp32: ``probs`` is
    [R * kv_heads, group, num_keys], the result [R * heads, d]."""
    if in_place:
        # embedding_bag reads the value rows where they lie in the cache and sums them weighted, so the
        # values are never gathered into a copy first (the batched matmul needs one).
        return F.embedding_bag(batch.value_bags, values, per_sample_weights=probs.flatten(0, 1), mode="sum")
    # embedding_bag weights rows in the table's dtype; lower-precision caches keep fp32 probabilities.
    v = values.index_select(0, batch.kv_rows).view(probs.shape[0], -1, values.shape[-1]).float()
    return torch.bmm(probs, v).flatten(0, 1)
