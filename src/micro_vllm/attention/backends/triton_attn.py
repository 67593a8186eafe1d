"""The ``triton`` attention backend: a KV-cache write kernel and one varlen paged-attention kernel.

This module owns the Triton kernels and the host code that sizes their grids; it is one file, longer
than the others, because each kernel's tile and split choices are only readable next to the kernel
they shape. The choices are made once: ``TritonAttentionMetadataBuilder``, made for a KV cache group
when the cache is allocated, checks the group's heads and derives from them and the cache's dtype
what no step changes; its ``build``, once per step, picks the tiles, the split count and the grid
(``_pick_tiles``, ``_num_splits``) into the step's ``TritonAttentionMetadata``, and each layer's
``write_and_attend`` only launches what that says.

* ``_write_kv_kernel`` scatters a step's K/V rows into the paged cache through ``slot_mapping``.
* ``_attention_kernel`` computes attention for a whole step in one launch: prefill chunks (with cached
  context before them) and decodes mixed, causal, GQA, optional sliding window, online softmax in fp32.
  In a decode step it also stores each request's new K/V (``WRITE_KV``), so no write launch precedes it:
  the loop reads the cached keys and the new token's key joins the softmax from registers.
  In a step with prefill chunks (``KV_FROM_STEP``, when the builder chooses it) the cached
  keys come through the pages and this step's own keys, which the write kernel has just stored, from
  the step's K/V rows: contiguous rows need no page lookup per key. On the long-prefill tiles the
  copy engine reads them (``STEP_KV_TMA``: each program builds tensor descriptors of its request's rows).
  For decode-only batches with few requests it runs split-KV ("flash decoding"): several programs
  share one request's context and ``_merge_splits_kernel`` combines their partial results.

Grid of the attention kernel: ``(num_kv_heads, query blocks, num_splits)``. The KV heads vary fastest,
so the programs of one query block start together: they read the same pages, where a token's K/V of
all heads lie side by side, while those pages are still in L2 (``benchmarks/attention_sweep.py``
measures the grid orders; docs/benchmarks.md, "Attention kernel choices").
A program owns ``BLOCK_Q`` consecutive query tokens of one request and all ``GROUP`` query heads that
share one KV head (``BLOCK_M = BLOCK_Q * GROUP`` rows of the score tile), so each K/V tile is loaded
once per group. It walks the request's context in tiles of ``TILE_N`` keys, reading pages through the
block table; only the tiles at the causal and window edges are masked. The number of query blocks is
an upper bound that needs no device data: ``num_tokens // BLOCK_Q + num_reqs`` (each request wastes at
most one partial block); a program finds its request by binary search over ``query_start_loc`` and
exits when it has no rows. The GPU starts programs roughly in index order, and a program running
alone at the end of a launch idles the other SMs, so the longest programs come first: these programs
take the query blocks last first (a request's later blocks see more keys). When no request has more
than ``BLOCK_Q`` queries (decode), program ``i`` simply serves request ``i``, or request
``decode_order[i]`` when the metadata has an order (longest context first).

An fp8 cache (``kv_cache_dtype="fp8"``) holds one byte per value: the kernels convert K/V as they
store them (saturating, ``_to_cache_dtype``) and widen each loaded tile to the query's dtype, so the
products and the softmax run as with a cache in the model's dtype, on half the bytes. A bf16 query
is first converted to fp16 (clamped to its range; fp16 holds bf16's values of that range exactly or
more precisely): the GPU widens two fp8 values to fp16 in one instruction, where bf16 takes several,
and with bf16 tiles the widening, not the reading, bounded the kernel. A step with prefill chunks reads
its own keys back from its rows (``KV_FROM_STEP``) as with any cache: its write launch first rounds the
rows to the values the cache holds (``_step_rows``), so the long-prompt tiles serve an fp8 cache too.

Head sizes need not be powers of two (80, 96, 12...): the kernels work on ``HEAD_PAD`` lanes, the
head size rounded up to a power of two and to at least 16 (``tl.arange`` and ``tl.dot`` need both),
and mask the lanes past the head, which load as 0 and so add nothing to either product. Heads of a
power of two >= 16 compile to the same code as without the masks. Heads wider than 256 are refused
(``supports_head_size``; the builder refuses them too).

CUDA graphs: the builder chooses the grid, the tile shape and the split count from ``num_reqs``, the
step's token count (``slot_mapping``'s rows), ``max_query_len``, the group's heads and cache dtype and
the device alone; never from sequence lengths, which the kernels read from ``seq_lens`` on the device.
A graph captured for a decode batch therefore needs no bound on ``max_seq_len``: it replays correctly
for any context lengths its block table covers. It needs a fixed ``num_reqs`` (``seq_lens_cpu.shape[0]``)
and ``max_query_len == 1``, so pad the batch with dummy requests rather than dropping them: a dummy may
have no query (``query_start_loc[i] == query_start_loc[i + 1]``, it costs nothing) or one query over
any ``seq_len`` its block-table row covers (``seq_len`` 1 on the null block is fine). A graph for steps
with prefill chunks is captured with a ``max_query_len`` that takes the prefill tiles, which have no
splits and search each program's request: its grid depends on ``num_tokens`` and ``num_reqs`` only, so
it replays any mix of query lengths up to that bound. Requests without a query own one program each,
which exits; padding tokens may form a dummy request whose block-table row is the null block.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from micro_vllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer

# Flash-decoding mode: at most this many splits per (request, KV head), each of at least this many
# keys (one decode tile of heads up to 128 wide). Splits are taken only while SMs would idle, and the
# merge costs the same however many splits hold keys, so a short context gains from spreading its
# tiles over more of them (latency at batch 1 and 8: docs/benchmarks.md, "Attention kernel choices").
_MAX_SPLITS = 16
_MIN_SPLIT_KEYS = 128
# Steps whose longest query has at least this many tokens take the long-prefill tiles (_pick_tiles).
# Mixed-step CUDA graphs of more tokens are captured for both tiles (TritonBackend.long_query_len).
_LONG_QUERY = 6144
_MAX_GRID_Y = 65535  # CUDA's bound on a grid's second dimension, where the query blocks are
# A program holds a [BLOCK_M, head size] fp32 accumulator and K/V tiles of the head size: past 256
# they no longer fit an SM's registers and shared memory (tests/helpers/hopper_compile.py compiles 256).
_MAX_HEAD_SIZE = 256


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_tok,
    cache_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROUND_ROWS: tl.constexpr,  # also overwrite the rows with what the cache holds (_step_rows)
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & _dim_mask(HEAD_SIZE, HEAD_PAD)[None, :]
    k_row = token * key_stride_t + heads * key_stride_h + dims
    v_row = token * value_stride_t + heads * value_stride_h + dims
    k = _to_cache_dtype(tl.load(key_ptr + k_row, mask=mask), k_cache_ptr)
    v = _to_cache_dtype(tl.load(value_ptr + v_row, mask=mask), v_cache_ptr)
    if ROUND_ROWS:  # padding rows too: whatever the attention reads from the rows is a number
        key_rows, value_rows = _step_rows(key_ptr, k_cache_ptr), _step_rows(value_ptr, v_cache_ptr)
        tl.store(key_rows + k_row, k.to(key_rows.dtype.element_ty), mask=mask)
        tl.store(value_rows + v_row, v.to(value_rows.dtype.element_ty), mask=mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    dst = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_tok
    dst += heads * cache_stride_head + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _to_cache_dtype(x, cache_ptr):
    """K or V as the cache stores them (abstract.to_cache_dtype's rule): an fp8 cache saturates at
    its largest finite value, whatever the conversion's lowering does with larger ones."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _step_rows(rows_ptr, cache_ptr):
    """A step's K or V rows as the attention kernel reads them back (``KV_FROM_STEP``). With an fp8
    cache the write launch first overwrites them with the values the cache holds (fp8 values are
    exact in every wider float type), in the dtype the products take: fp16 for a bf16 model, whose
    two-byte rows then hold fp16 values. The prefill tiles then stream them as they stream any
    cache's rows, and a key weighs the same in this step as in every later one."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        if rows_ptr.dtype.element_ty == tl.bfloat16:
            rows_ptr = rows_ptr.to(tl.pointer_type(tl.float16))
    return rows_ptr


@triton.jit
def _dim_mask(HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Which of the HEAD_PAD lanes are channels of the head (tl.arange needs a power of two, tl.dot
    at least 16). Without padding it is a constant all-true mask, which the compiler drops from
    loads and stores: power-of-two heads pay nothing for it."""
    if HEAD_PAD == HEAD_SIZE:
        valid = tl.full([HEAD_PAD], 1, tl.int1)
    else:
        valid = tl.arange(0, HEAD_PAD) < HEAD_SIZE
    return valid


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, qblock, BLOCK_Q: tl.constexpr):
    """The request owning query block ``qblock``: request i's blocks start at qsl[i] // BLOCK_Q + i."""
    # Tensors, not Python ints: Triton specialises num_reqs == 1 into a constant.
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= qblock:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _kv_offsets(offsets, keys, key_valid, block_row, stride_block, stride_k, stride_v,
                BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, FROM_STEP: tl.constexpr):
    """Where a tile's keys and values are, as element offsets from ``k_base`` and ``v_base``: rows
    ``offsets`` of this step's K/V (``FROM_STEP``), or the slots of cached ``keys`` in their pages."""
    if FROM_STEP:
        return offsets.to(tl.int64) * stride_k, offsets.to(tl.int64) * stride_v
    if MASKED:
        page = tl.load(block_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    else:
        page = tl.load(block_row + keys // BLOCK_SIZE).to(tl.int64)
    k_offset = page * stride_block + (keys % BLOCK_SIZE) * stride_k
    return k_offset, k_offset


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos, tile, first_key, block_row, k_base, v_base, key_start, key_end, window,
    scale_log2, stride_block, stride_k, stride_v,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MASKED: tl.constexpr,  # False only for tiles every row sees in full
    HAS_WINDOW: tl.constexpr,
    FROM_STEP: tl.constexpr,  # the keys are this step's rows, not cached pages
    STEP_KV_TMA: tl.constexpr,  # FROM_STEP only: k_base and v_base are tensor descriptors of the rows
):
    """One online-softmax step over keys [first_key + tile * TILE_N, first_key + (tile + 1) * TILE_N).

    Cached keys (``first_key`` 0) are read through the pages; this step's keys (``FROM_STEP``,
    ``first_key`` the request's context length) are rows of its key and value tensors, whose bases
    ``k_base`` and ``v_base`` are then the request's first row, or with ``STEP_KV_TMA`` descriptors of
    the request's rows: the copy engine reads the tile, and rows past the request's read as 0."""
    offsets = tile * TILE_N + tl.arange(0, TILE_N)
    keys = first_key + offsets
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = _dim_mask(HEAD_SIZE, HEAD_PAD)  # padding lanes load 0, so they add 0 to both dots
    # Never touch a key outside [key_start, key_end): its table entry may be a null block and slots
    # past seq_len hold stale data; masked loads return 0, so no NaN reaches P @ V. Tiles every row
    # sees in full need no key mask (the compiler drops key_valid there).
    key_valid = (keys >= key_start) & (keys < key_end)
    if MASKED:
        k_mask = key_valid[None, :] & dim_valid[:, None]
        v_mask = key_valid[:, None] & dim_valid[None, :]
    else:
        k_mask, v_mask = dim_valid[:, None], dim_valid[None, :]
    if STEP_KV_TMA:
        k = k_base.load([tile * TILE_N, 0]).T.to(q.dtype)
        v = v_base.load([tile * TILE_N, 0]).to(q.dtype)
    else:
        k_offset, v_offset = _kv_offsets(offsets, keys, key_valid, block_row, stride_block, stride_k, stride_v,
                                         BLOCK_SIZE, MASKED, FROM_STEP)
        # An fp8 cache widens to the query's type here (fp16 for a bf16 model), so both products run as without it.
        k = tl.load(k_base + k_offset[None, :] + dims[:, None], mask=k_mask, other=0.0).to(q.dtype)
        v = tl.load(v_base + v_offset[:, None] + dims[None, :], mask=v_mask, other=0.0).to(q.dtype)

    # "ieee": fp32 products exact, not rounded to tf32; 16-bit products compile the same whatever it says.
    s = tl.dot(q, k, input_precision="ieee")  # scaled below, inside the exponent's FMA
    if MASKED:
        # Causal, and inside the keys read: with WRITE_KV a query's own key is visible but not read here.
        visible = (keys[None, :] <= q_pos[:, None]) & (keys < key_end)[None, :]
        if HAS_WINDOW:
            visible &= keys[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # The rescaled accumulator is the product's own: no second register tile, no separate add.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, q_pos, tile_begin, full_begin, full_end, tile_end, first_key, block_row, k_base, v_base,
    key_start, key_end, window, scale_log2, stride_block, stride_k, stride_v,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FROM_STEP: tl.constexpr,
    STEP_KV_TMA: tl.constexpr,
):
    """Tiles [tile_begin, tile_end) of one key source (``_attend_tile``). Those in [full_begin,
    full_end) are visible to every row (no causal or window edge inside) and skip all masking; only
    the first and last few tiles of a range need it."""
    full_begin = tl.minimum(tl.maximum(full_begin, tile_begin), tile_end)
    full_end = tl.minimum(tl.maximum(full_end, full_begin), tile_end)
    for part in tl.static_range(3):  # masked edge tiles, the unmasked middle, masked edge tiles
        if part == 0:
            begin, end = tile_begin, full_begin
        elif part == 1:
            begin, end = full_begin, full_end
        else:
            begin, end = full_end, tile_end
        for tile in range(begin, end):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, tile, first_key, block_row, k_base, v_base, key_start, key_end, window,
                scale_log2, stride_block, stride_k, stride_v,
                BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, part != 1, HAS_WINDOW, FROM_STEP, STEP_KV_TMA,
            )
    return acc, m_i, l_i


# Per-step counts are not specialised on (== 1, multiple of 16): each new pattern would compile
# another variant of the kernel in the middle of serving.
@triton.jit(do_not_specialize=["num_reqs"])
def _attention_kernel(
    out_ptr,  # [T, H, D], or the split partials when NUM_SPLITS > 1
    lse_ptr,  # [T, H, NUM_SPLITS] fp32 log2-sum-exp per split (only when NUM_SPLITS > 1)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    req_order_ptr,  # [num_reqs] int32, decode tiles with HAS_ORDER: program i serves req_order[i]
    key_ptr,  # [T, num_kv_heads, HEAD_SIZE] this step's K/V, stored into the cache (WRITE_KV only)
    value_ptr,
    slot_ptr,
    num_reqs,
    scale_log2,  # softmax scale * log2(e): scores live in base 2 so exp2 is one instruction
    window,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    out_stride_split,
    lse_stride_t,
    lse_stride_h,
    cache_stride_block,
    cache_stride_tok,
    cache_stride_head,
    block_table_stride,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_SIZE rounded up to a power of two >= 16 (tl.arange and tl.dot need it)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV page
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # score-tile rows: BLOCK_Q * GROUP rounded up to a power of two
    TILE_N: tl.constexpr,  # keys per loop iteration
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,  # fewest tiles a split takes (flash-decoding mode)
    ONE_QBLOCK_PER_REQ: tl.constexpr,  # every request has <= BLOCK_Q queries: program i = request i
    HAS_ORDER: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WRITE_KV: tl.constexpr,  # decode only: store each request's new K/V here instead of a launch of its own
    KV_FROM_STEP: tl.constexpr,  # steps with prefill chunks: read this step's keys from key_ptr/value_ptr
    STEP_KV_TMA: tl.constexpr,  # KV_FROM_STEP through tensor descriptors (_pick_tiles says when)
):
    kv_head = tl.program_id(0)
    qblock = tl.program_id(1)
    if not ONE_QBLOCK_PER_REQ:
        # Last block first: a request's later query blocks see more keys, so the longest programs
        # start first instead of running alone at the end of the launch.
        qblock = tl.num_programs(1) - 1 - qblock
    split = tl.program_id(2)

    if ONE_QBLOCK_PER_REQ:
        if HAS_ORDER:
            req = tl.load(req_order_ptr + qblock)
        else:
            req = qblock
        first_q = 0
    else:
        req = _find_request(query_start_loc_ptr, num_reqs, qblock, BLOCK_Q)
        first_q = (qblock - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)) * BLOCK_Q
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    if first_q >= q_len:  # a spare program of the upper-bound grid
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # cached tokens before this step's queries

    # Row r of the score tile is query token first_q + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_local = first_q + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = context_len + q_local
    token = (q_begin + q_local).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = _dim_mask(HEAD_SIZE, HEAD_PAD)
    q = tl.load(
        q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        if q.dtype == tl.bfloat16:  # the fp8 tiles then widen to fp16 (module docstring)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Keys this query block can see: causal end at its last query, window start at its first.
    key_end = context_len + tl.minimum(first_q + BLOCK_Q, q_len)
    key_start = 0
    if HAS_WINDOW:
        key_start = tl.maximum(context_len + first_q - window + 1, 0)
    # Keys read from the cache. With WRITE_KV the request's one new token, its last key, is not in
    # the cache yet: it comes from the step's key/value rows, after the loops. With KV_FROM_STEP
    # every key of this step comes from those rows.
    cache_end = key_end - 1 if WRITE_KV else key_end
    if KV_FROM_STEP:
        cache_end = context_len
    tile_begin = key_start // TILE_N
    tile_end = tl.cdiv(cache_end, TILE_N)
    cache_tile_end = tile_end
    full_begin = tile_begin
    if HAS_WINDOW:
        full_begin = tl.cdiv(tl.maximum(key_end - window, 0), TILE_N)
    full_end = tl.minimum((context_len + first_q + 1) // TILE_N, cache_end // TILE_N)
    if NUM_SPLITS > 1:
        # Splits of at least MIN_SPLIT_TILES: short contexts use fewer programs (the rest exit at
        # once), so one grid serves any context length, as a captured graph needs.
        tiles_per_split = tl.maximum(tl.cdiv(tile_end - tile_begin, NUM_SPLITS), MIN_SPLIT_TILES)
        tile_begin = tl.minimum(tile_begin + split * tiles_per_split, tile_end)
        tile_end = tl.minimum(tile_begin + tiles_per_split, tile_end)
    if WRITE_KV:  # loaded before the loops, so their latency hides behind them
        token_row = q_begin.to(tl.int64)
        slot = tl.load(slot_ptr + token_row)
        # As the cache will hold them, so the new key counts as the cached keys do.
        new_k = _to_cache_dtype(tl.load(key_ptr + token_row * key_stride_t + kv_head * key_stride_h + dims,
                                        mask=dim_valid, other=0.0), k_cache_ptr)
        new_v = _to_cache_dtype(tl.load(value_ptr + token_row * value_stride_t + kv_head * value_stride_h + dims,
                                        mask=dim_valid, other=0.0), v_cache_ptr)

    # A finite floor (not -inf) keeps exp2(m_old - m_new) defined for rows that saw no key yet.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    block_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    k_base = k_cache_ptr + kv_head.to(tl.int64) * cache_stride_head
    v_base = v_cache_ptr + kv_head.to(tl.int64) * cache_stride_head
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, q_pos, tile_begin, full_begin, full_end, tile_end, 0, block_row, k_base, v_base,
        key_start, cache_end, window, scale_log2, cache_stride_block, cache_stride_tok, cache_stride_tok,
        BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, HAS_WINDOW, False, False,
    )
    if KV_FROM_STEP:
        # This step's keys, after the cached ones (steps with prefill chunks have one split). Row j
        # of the request's K/V holds key context_len + j. Tiles count from context_len, so a query
        # block's causal edge falls inside the same tiles whatever the context.
        tl.static_assert(NUM_SPLITS == 1)
        step_begin = tl.maximum(key_start - context_len, 0) // TILE_N
        step_full_begin = step_begin
        if HAS_WINDOW:
            step_full_begin = tl.cdiv(tl.maximum(key_end - window - context_len, 0), TILE_N)
        first_row = q_begin.to(tl.int64)
        k_rows = _step_rows(key_ptr, k_cache_ptr) + first_row * key_stride_t + kv_head.to(tl.int64) * key_stride_h
        v_rows = _step_rows(value_ptr, v_cache_ptr) + first_row * value_stride_t + kv_head.to(tl.int64) * value_stride_h
        if STEP_KV_TMA:  # the request's rows: a tile past them reads 0, as a masked load would
            k_rows = tl.make_tensor_descriptor(k_rows, shape=[q_len, HEAD_SIZE], strides=[key_stride_t, 1],
                                               block_shape=[TILE_N, HEAD_PAD])
            v_rows = tl.make_tensor_descriptor(v_rows, shape=[q_len, HEAD_SIZE], strides=[value_stride_t, 1],
                                               block_shape=[TILE_N, HEAD_PAD])
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, step_begin, step_full_begin, (first_q + 1) // TILE_N,
            tl.cdiv(key_end - context_len, TILE_N), context_len, block_row, k_rows, v_rows,
            key_start, key_end, window, scale_log2, 0, key_stride_t, value_stride_t,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, HAS_WINDOW, True, STEP_KV_TMA,
        )
    # The new token's key, in the program whose range ends the cached keys (split 0 when none is
    # cached): one more online-softmax column, then its K/V go to the cache for later steps.
    if WRITE_KV:
        if (tile_end == cache_tile_end) & ((tile_begin < tile_end) | (split == 0)):
            s_new = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], axis=1) * scale_log2
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.math.exp2(m_i - m_new)
            p_new = tl.math.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * new_v.to(tl.float32)[None, :]
            m_i = m_new
            if slot >= 0:
                dst = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_tok
                dst += kv_head.to(tl.int64) * cache_stride_head + dims
                tl.store(k_cache_ptr + dst, new_k, mask=dim_valid)
                tl.store(v_cache_ptr + dst, new_v, mask=dim_valid)

    # l_i is 0 only for rows that saw no key (padding rows, empty splits): emit 0, not NaN.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_offset = token[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :]
    if NUM_SPLITS > 1:
        out_offset += split * out_stride_split
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * lse_stride_t + head * lse_stride_h + split, lse, mask=row_valid)
    tl.store(out_ptr + out_offset, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_ptr,  # [T, H, NUM_SPLITS, D] fp32, each split normalised by its own sum
    lse_ptr,  # [T, H, NUM_SPLITS] fp32, base 2
    num_tokens_ptr,  # query_start_loc[num_reqs]: rows past it are padding with no partials
    out_stride_t,
    out_stride_h,
    partial_stride_t,
    partial_stride_h,
    lse_stride_t,
    lse_stride_h,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(num_tokens_ptr):
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = _dim_mask(HEAD_SIZE, HEAD_PAD)
    lse_row = lse_ptr + token * lse_stride_t + head * lse_stride_h
    lse = tl.load(lse_row + splits, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.math.exp2(lse - m)  # empty splits (lse = -inf) weigh 0
    partial_row = partial_ptr + token * partial_stride_t + head * partial_stride_h
    partial = tl.load(
        partial_row + splits[:, None] * HEAD_SIZE + dims[None, :],
        mask=split_mask[:, None] & dim_valid[None, :],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * out_stride_t + head * out_stride_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_valid)


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory in which a launch's programs build their tensor descriptors (Triton asks at launch).
    PyTorch's caching allocator serves it on the current stream, the launch's, aligned to 512 bytes:
    more than the descriptors' ``alignment`` asks."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def _head_pad(head_size: int) -> int:
    return max(16, triton.next_power_of_2(head_size))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(device: torch.device, num_reqs: int, num_kv_heads: int, max_query_len: int) -> int:
    """How many programs share one (request, KV head) of a decode batch.

    Only decode-only batches split, and only when (request, KV head) pairs alone leave SMs idle; the
    count depends on nothing that changes between replays of a captured decode graph.
    """
    if max_query_len != 1 or device.type != "cuda":
        return 1
    # Aim at about two programs per SM, as many as fit: a split decode program of head size 128 takes
    # over a third of an SM's registers (tests/helpers/hopper_compile.py prints them). Round the share
    # of each pair up: with 2 * SMs or more (request, KV head) pairs, splitting only adds the merge, and
    # more programs per SM only queue (benchmarks/attention_sweep.py; docs/benchmarks.md, "Attention
    # kernel choices").
    per_pair = -(-2 * _num_sms(device) // (num_reqs * num_kv_heads))
    if per_pair < 2:
        return 1
    return min(_MAX_SPLITS, 1 << (per_pair.bit_length() - 1))  # a power of two: fewer compiled variants


class _Tiles(NamedTuple):
    block_m: int  # score-tile rows (query tokens x query heads of one KV head)
    tile_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int
    # Decode tiles hold each request's queries in one block, so a program per request needs no
    # search. Prefill tiles always take the general path: one compiled variant for every prefill.
    one_qblock_per_req: bool
    step_kv_tma: bool = False  # this step's K/V rows come through tensor descriptors (TMA)
    max_registers: int | None = None  # a cap on a program's registers a thread (Triton's maxnreg)


def _pick_tiles(max_query_len: int, group: int, head_size: int, fp8_cache: bool = False,
                fp32: bool = False, step_kv_aligned: bool = False) -> _Tiles:
    """Tile shape and launch parameters for a step of this shape (the builder asks once per step).

    Decode-like batches take 16 rows, the smallest tl.dot, and are memory-bound; prefill takes a
    taller tile so each K/V tile loaded serves more queries. ``step_kv_aligned``: the step's own K/V
    rows are in the query's dtype at addresses and strides TMA can copy (the builder's rule).
    """
    if max_query_len * group <= 16:  # then max_query_len <= 16 // group, the tile's query tokens
        if _head_pad(head_size) > 128:
            # Wider heads take half as many keys per step: 128 keys of 256 channels spill registers
            # on sm_90 (tests/helpers/hopper_compile.py).
            return _Tiles(16, 64, 4, 3, one_qblock_per_req=True)
        # A 16-bit model's program on an fp8 cache widens its K/V tiles in registers: it takes 249 a
        # thread, two programs an SM. Capped at 168, three fit, and a batch that fills the SMs runs 10%
        # faster (256 decodes) though each program is slower; the builder drops the cap where a batch
        # splits, as it leaves SMs idle anyway (docs/benchmarks.md, "Attention kernel choices").
        capped = fp8_cache and not fp32
        return _Tiles(16, 128, 4, 3, one_qblock_per_req=True, max_registers=168 if capped else None)
    rows = max(64, triton.next_power_of_2(group))
    if _head_pad(head_size) <= 128:  # wider heads fill the registers with the tile below already
        # Long prompts take twice the rows on two warpgroups and 64 keys a step: each K/V tile then
        # serves twice the queries and each rescale of the accumulator twice the keys, which pays
        # once most of a program's tiles are unmasked; on short prompts it does not. Three stages
        # hold one program per SM, which with the longest programs started first beats two programs
        # of two stages each; fp32 tiles keep two, as three come within 3 KB of a block's shared
        # memory (tests/helpers/hopper_compile.py; docs/benchmarks.md, "Attention kernel choices").
        # The step's own rows come by TMA when they can: the copies take no registers for
        # addresses, which is what lets 128 keys a step fit without spilling (with loads through
        # pointers they spill). Only these tiles use it: with two stages ptxas crashes on the
        # descriptor loads (Triton 3.6).
        if max_query_len >= _LONG_QUERY:
            if fp32:
                return _Tiles(max(128, rows), 64, 8, 2, one_qblock_per_req=False)
            return _Tiles(max(128, rows), 128 if step_kv_aligned else 64, 8, 3, one_qblock_per_req=False,
                          step_kv_tma=step_kv_aligned)
        # An fp8 cache's K/V tiles are widened in registers and stored to shared memory again for
        # the products: 64 keys a step pay that round trip for twice the keys.
        if fp8_cache:
            return _Tiles(rows, 64, 4, 2, one_qblock_per_req=False)
    # 32 keys per step: the tall query tile already fills the registers, so a narrower key tile
    # keeps more stages in flight (docs/benchmarks.md, "Attention kernel choices").
    return _Tiles(rows, 32, 4, 2, one_qblock_per_req=False)


class _GroupShape(NamedTuple):
    """The heads and pages of a KV cache group's layers, as every launch for them takes them."""

    num_kv_heads: int
    group: int  # query heads per KV head
    head_size: int
    head_pad: int  # the head size rounded up to a power of two >= 16 (tl.arange and tl.dot need both)
    block_size: int  # tokens per page


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """One step's launch for every layer of a KV cache group, chosen once by the group's builder."""

    shape: _GroupShape
    tiles: _Tiles
    num_query_blocks: int  # the grid's second dimension; 0 when the step has no query
    num_splits: int  # programs per (request, KV head); more than 1: flash decoding, then the merge
    write_kv_in_launch: bool  # a decode step: the attention launch stores the step's K/V (no write launch)
    kv_from_step: bool  # the step's own keys come from its K/V rows, not back through the pages
    # kv_from_step with an fp8 cache: the write launch first rounds the rows to the cache's values (_step_rows)
    round_step_rows: bool
    # int32 [num_reqs], decode steps only: the order in which the kernel starts the requests' programs
    # (longest context first, so the long programs do not finish last); None: request order.
    decode_order: torch.Tensor | None = None


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Checks a KV cache group's layers once, when the KV cache is allocated, and derives what no step
    changes; ``build`` then chooses each step's tiles, split count and grid, which the group's layers
    only launch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        spec = self.spec
        if not TritonBackend.supports_head_size(spec.head_size):
            raise ValueError(
                f"head_size={spec.head_size} is not served by the triton backend: at most {_MAX_HEAD_SIZE}"
            )
        self.shape = _GroupShape(spec.num_kv_heads, self.num_heads // spec.num_kv_heads, spec.head_size,
                                 _head_pad(spec.head_size), self.block_size)
        # The cache holds K/V in the model's dtype (that of the queries and the step's K/V rows) or
        # in fp8 (AttentionBackend): the two say which tiles fit.
        self.fp8_cache = self.kv_cache_dtype == torch.float8_e4m3fn
        self.fp32 = self.dtype == torch.float32
        # Steps with prefill chunks read their own keys from the step's K/V rows rather than back
        # through the pages: contiguous rows need no page lookup per key, so the prefill tiles stream
        # them as plain tiles (benchmarks/attention_sweep.py), an fp8 cache's as its write launch
        # rounded them (_step_rows). Not for heads wider than 128, whose programs run out of
        # registers with both key sources (tests/helpers/hopper_compile.py); ``build`` also leaves
        # it to the decode tiles.
        self.kv_from_step = self.shape.head_pad <= 128
        # TMA copies rows whose start and strides are multiples of 16 bytes. A layer's K/V rows start
        # and step by whole heads within its projections' outputs (allocated at coarser alignments),
        # so they are when a head is.
        self.step_kv_aligned = spec.head_size * self.dtype.itemsize % 16 == 0
        self.decode_order = CpuGpuBuffer((self.max_num_reqs,), torch.int32, self.device)
        # The context lengths of a decode step that keeps the staged order: those it was sorted for,
        # each one longer (adding the same to every length changes no comparison, ties included),
        # except rows of length 1, which stay 1: a decode batch padded to a CUDA graph's size pads
        # with such rows, and they stay tied below every other row. Only the first
        # ``num_reqs_keeping_order`` entries are those lengths.
        self.seq_lens_keeping_order = np.empty(self.max_num_reqs, np.int32)
        self.num_reqs_keeping_order = 0

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """The step's tiles and split count, from its shape alone (never from sequence lengths, so
        that a captured CUDA graph replays for any), its grid, and for a decode step the order of its
        programs."""
        shape, max_query_len = self.shape, common.max_query_len
        num_reqs, num_tokens = common.num_reqs, common.slot_mapping.shape[0]  # the query's rows, padding included
        tiles = _pick_tiles(max_query_len, shape.group, shape.head_size, self.fp8_cache, self.fp32,
                            self.step_kv_aligned)
        one_qblock = tiles.one_qblock_per_req
        num_query_blocks = num_reqs if one_qblock else num_tokens // (tiles.block_m // shape.group) + num_reqs
        if num_query_blocks > _MAX_GRID_Y:
            raise ValueError(
                f"a step of {num_tokens} tokens needs {num_query_blocks} query blocks; at most {_MAX_GRID_Y} fit a grid"
            )
        decodes = one_qblock and common.num_actual_tokens == num_reqs
        num_splits = _num_splits(self.device, num_reqs, shape.num_kv_heads, max_query_len)
        if num_splits > 1:  # a register cap pays only where the programs fill the SMs (_pick_tiles)
            tiles = tiles._replace(max_registers=None)
        # The decode tiles take no second key loop: it would get pipeline buffers of its own,
        # doubling their shared memory (fp32 heads of 128 then overflow an H200 block).
        kv_from_step = self.kv_from_step and not one_qblock
        return TritonAttentionMetadata(
            common, shape, tiles,
            num_query_blocks=num_query_blocks if num_reqs and num_tokens else 0,  # 0: no launch
            num_splits=num_splits,
            write_kv_in_launch=max_query_len == 1,
            kv_from_step=kv_from_step,
            round_step_rows=kv_from_step and self.fp8_cache,
            decode_order=self._decode_order(common) if decodes else None,
        )

    def _decode_order(self, common: CommonAttentionMetadata) -> torch.Tensor:
        """The requests longest context first, on the device. Sorted again only when the lengths are
        not those of the last decode step each grown by one, padding rows aside (most decode steps
        keep their requests, and each request grows by its token)."""
        num_reqs = common.num_reqs
        seq_lens = common.seq_lens_cpu.numpy()
        keeping_order = self.seq_lens_keeping_order[:num_reqs]
        # Both int32: equal bytes are equal lengths, compared in one call instead of a comparison and a reduction.
        if num_reqs != self.num_reqs_keeping_order or seq_lens.tobytes() != keeping_order.tobytes():
            self.decode_order.np[:num_reqs] = np.argsort(-seq_lens, kind="stable")
        np.add(seq_lens, seq_lens != 1, out=keeping_order)
        self.num_reqs_keeping_order = num_reqs
        return self.decode_order.copy_to_device(num_reqs)


class TritonBackend(AttentionBackend):
    """The kernels above behind the backend interface. Query, key and value come as a layer's views of
    its projections: unit stride across a head's channels, and (what TMA needs, see the builder's
    ``step_kv_aligned``) rows at multiples of 16 bytes when a head is."""

    builder_cls = TritonAttentionMetadataBuilder
    cuda_graph_safe = True  # grids depend on batch shape only; lengths are read on the device
    long_query_len = _LONG_QUERY  # the long-prefill tiles (_pick_tiles)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= _MAX_HEAD_SIZE

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        round_rows: bool = False,
    ) -> None:
        """Store the step's K/V; with ``round_rows`` (the metadata's ``round_step_rows``: an fp8 cache
        whose step is read back from its rows) also overwrite ``key`` and ``value`` with what the cache
        holds, in the dtype the attention kernel reads them in (_step_rows)."""
        num_tokens = slot_mapping.shape[0]
        if num_tokens == 0:
            return
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _write_kv_kernel[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HEAD_SIZE=head_size,
            HEAD_PAD=_head_pad(head_size),
            BLOCK_SIZE=block_size,
            ROUND_ROWS=round_rows,
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attention over the cache alone, which holds the step's K/V already (layers run
        ``write_and_attend``; the tests hold this to the reference): the step's launch with every
        key read through the pages."""
        through_pages = dataclasses.replace(metadata, tiles=metadata.tiles._replace(step_kv_tma=False),
                                            write_kv_in_launch=False, kv_from_step=False)
        # The launch reads no K/V rows: the query stands in for them.
        return self._attend(query, query, query, kv_cache, through_pages, scale, sliding_window)

    def write_and_attend(self, query, key, value, kv_cache, metadata: TritonAttentionMetadata, *, scale,
                         sliding_window):
        """Decode steps store their new K/V inside the attention launch (one launch per layer
        fewer). The new key joins the softmax from registers rather than being stored first and read
        back behind a barrier, which costs more than the separate launch it saves. Steps with longer
        queries write first, for the steps after them, then attend with this step's rows at hand
        (the builder's ``kv_from_step`` says whether their keys are read from them)."""
        if not metadata.write_kv_in_launch:
            self.write_kv(key, value, kv_cache, metadata.common.slot_mapping, round_rows=metadata.round_step_rows)
        return self._attend(query, key, value, kv_cache, metadata, scale, sliding_window)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        """The step's launch as its metadata plans it, over this layer's tensors: attention over the
        cache and this step's K/V rows ``key`` and ``value`` (stored by a decode step's launch, read
        by a step with prefill chunks where ``kv_from_step``), then the merge of the splits."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous for .view()
        if metadata.num_query_blocks == 0:
            return out
        common, shape, tiles, num_splits = metadata.common, metadata.shape, metadata.tiles, metadata.num_splits
        if num_splits > 1:
            partial = torch.empty(*query.shape[:2], num_splits, shape.head_size, dtype=torch.float32,
                                  device=query.device)
            lse = torch.empty(*query.shape[:2], num_splits, dtype=torch.float32, device=query.device)
            target, split_stride, lse_t, lse_h = partial, partial.stride(2), lse.stride(0), lse.stride(1)
        else:
            target, lse, split_stride, lse_t, lse_h = out, out, 0, 0, 0
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if tiles.step_kv_tma:  # a ContextVar: set in the thread that launches
            triton.set_allocator(_descriptor_scratch)
        order = metadata.decode_order
        _attention_kernel[(shape.num_kv_heads, metadata.num_query_blocks, num_splits)](
            target,
            lse,
            query,
            k_cache,
            v_cache,
            common.block_table,
            common.seq_lens,
            common.query_start_loc,
            order if order is not None else common.seq_lens,  # the latter unread
            key,
            value,
            common.slot_mapping,
            common.num_reqs,
            scale * math.log2(math.e),
            sliding_window or 0,
            query.stride(0),
            query.stride(1),
            target.stride(0),
            target.stride(1),
            split_stride,
            lse_t,
            lse_h,
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            common.block_table.stride(0),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            GROUP=shape.group,
            HEAD_SIZE=shape.head_size,
            HEAD_PAD=shape.head_pad,
            BLOCK_SIZE=shape.block_size,
            BLOCK_Q=tiles.block_m // shape.group,
            BLOCK_M=tiles.block_m,
            TILE_N=tiles.tile_n,
            NUM_SPLITS=num_splits,
            MIN_SPLIT_TILES=max(1, _MIN_SPLIT_KEYS // tiles.tile_n),
            ONE_QBLOCK_PER_REQ=tiles.one_qblock_per_req,
            HAS_ORDER=order is not None,
            HAS_WINDOW=sliding_window is not None,
            WRITE_KV=metadata.write_kv_in_launch,
            KV_FROM_STEP=metadata.kv_from_step,
            STEP_KV_TMA=tiles.step_kv_tma,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            maxnreg=tiles.max_registers,
        )
        if num_splits > 1:
            _merge_splits_kernel[(query.shape[0], query.shape[1])](
                out,
                partial,
                lse,
                common.query_start_loc[common.num_reqs:],
                out.stride(0),
                out.stride(1),
                partial.stride(0),
                partial.stride(1),
                lse.stride(0),
                lse.stride(1),
                NUM_SPLITS=num_splits,
                SPLITS_PAD=triton.next_power_of_2(num_splits),
                HEAD_SIZE=shape.head_size,
                HEAD_PAD=shape.head_pad,
                num_warps=4,
            )
        return out
