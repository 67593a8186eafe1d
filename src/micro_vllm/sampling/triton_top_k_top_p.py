"""Each row's top-k / top-p threshold on CUDA, without sorting or selecting, in passes spread over the GPU.

Top-k keeps the tokens at least as large as the row's k-th largest logit; top-p, over those, keeps
the tokens whose probability strictly above them is at most ``top_p`` (``sampler.top_k_top_p_threshold``
is the definition). Both are the smallest logit ``t`` of the row with ``above(t) <= limit``, for a
measure of what lies above that falls as ``t`` rises: the number of tokens ``x > t`` with the limit
``k - 1``, or their share of the softmax mass with the limit ``top_p``. One search finds either
(``BY_COUNT`` picks the measure: a token weighs 1 or ``exp(x - max)``), and a row with both runs
top-k first and then top-p over the tokens at least as large as its top-k threshold (the ``floor``;
those below weigh nothing, as if -inf). The sort-based definition sorts 151,936 logits a row, or
``torch.topk`` selects its best ones; this finds the same logit in a few reading passes. A pass over a
row is cut into chunks (one program per row and chunk), so that every SM reads at any batch size, and
a small program per row joins the chunks' sums:

1. each chunk's maximum and sum of ``exp(x - max)`` (top-p), or its maximum, smallest finite token
   and number of finite tokens (top-k); from them the row's maximum ``m`` and total ``Z`` (1 for
   top-k, where the weights are counts);
2. the threshold lies in the bracket ``(lo, m]``: for top-p ``lo = m + ln((1 - top_p) * Z / V) - 1``
   (tokens below ``m + ln((1 - top_p) * Z / V)`` hold less than ``1 - top_p`` of the mass together,
   so the mass above any of them exceeds ``top_p`` and all of them are dropped; the 1 is a margin for
   rounding), for top-k just below the smallest finite token (a row with fewer than k finite tokens
   keeps them all);
3. a cut: each chunk sums the weight and counts the tokens above each of ``PIVOTS`` evenly spaced
   values of the bracket, and the row keeps the piece in which the weight above crosses the limit;
4. the piece's tokens are gathered, in row order (each chunk at the offset the cut's counts give it),
   and the weight above them kept: the later cuts read these alone, a few thousand tokens where a
   flat row (a random model's) holds most of its 151,936 in the first bracket;
5. more cuts (``PARALLEL_PASSES``, a row that is done skips the rest), until the bracket holds at
   most ``CAP`` tokens, or it cannot be cut (it is one value wide);
6. per row, the bracket's tokens in order; the weight above each is the weight above the bracket plus
   that of the others larger than it, and the threshold is the smallest whose weight above is within
   the limit (a tie is kept or dropped as one, as the definition keeps it). A row still too full
   after the cuts of step 5 (thousands of distinct logits within a hair of each other) is cut on here
   first, by its own program.

The logits are read times each row's inverse temperature when one is given, the same product as the
Sampler's ``logits * (1 / T)``, so that the Sampler needs no scaled copy of its logits. Counts are
whole numbers in fp32 (exact below 2**24 tokens), so a top-k threshold is the definition's exactly.
Every sum of mass is a fixed-order sum over the row's own tokens, so a row's threshold does not depend
on its batch; a top-p threshold can differ from the sorted definition's only where a token's mass
above lies within fp32 rounding of ``top_p`` (the sums add the same terms in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 4096  # tokens of a row per program of the chunked passes: 38 per row of 151,936
_BLOCK = 1024  # tokens per loop iteration of the maximum / sum and gathering passes
# The cutting passes keep per lane a sum and a count for each pivot ([SEARCH_BLOCK, PIVOTS] of each):
# 16 pivots shrink the bracket 16-fold a pass, within the registers of 4 warps.
_SEARCH_BLOCK = 256
_PIVOTS = 16
_CAP = 1024  # the most tokens the last pass gathers
_COMPARE = 8  # gathered tokens compared with all the others at a time
# Cuts over the gathered tokens after the first: with it, four 16-fold cuts take a bracket from about
# 20 nats wide to 1/3,000 of a nat, which leaves a few hundred of a flat row's tokens.
_PARALLEL_PASSES = 3
_MAX_PASSES = 40  # 16**40 = 2**160: more than any bracket of fp32 values needs to be one value wide

# What a row's program does next (``phase``).
_NO_THRESHOLD = tl.constexpr(0)  # top-p off, or a row of -inf only: every token stays
_CUTTING = tl.constexpr(1)
_GATHERING = tl.constexpr(2)


@triton.jit
def _load_row(row_ptr, cols, end, scale, floor):
    """The tokens ``cols`` before ``end``, in fp32 times ``scale``, -inf below ``floor`` and past
    ``end``: the product is the Sampler's own ``logits * (1 / T)``."""
    x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * scale
    return tl.where(x < floor, float("-inf"), x)


@triton.jit
def _active(limit, BY_COUNT: tl.constexpr):
    """Whether a row's filter is on: top-k 0 (limit -1) and top-p 1 are off."""
    if BY_COUNT:
        return limit >= 0
    return limit < 1


@triton.jit
def _weight(x, row_max, BY_COUNT: tl.constexpr):
    """What a token weighs in the measure above a value: 1 for top-k, its softmax mass relative to
    ``exp(row_max)`` for top-p (0 for a -inf token either way)."""
    if BY_COUNT:
        return tl.where(x > float("-inf"), 1.0, 0.0)
    return tl.exp(x - row_max)


@triton.jit
def _max_and_sum(row_ptr, start, end, scale, floor, BLOCK: tl.constexpr):
    """The maximum of the tokens ``start..end`` and the sum of ``exp(x - max)`` (online: per lane,
    rescaled once per block)."""
    row_max = float("-inf")
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for block_start in range(start, end, BLOCK):
        x = _load_row(row_ptr, block_start + tl.arange(0, BLOCK), end, scale, floor)
        new_max = tl.maximum(row_max, tl.max(x, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf block adds exp(-inf) = 0
        total = total * tl.exp(row_max - shift) + tl.exp(x - shift)
        row_max = new_max
    return row_max, tl.sum(total, 0)


@triton.jit
def _max_min_count(row_ptr, start, end, scale, BLOCK: tl.constexpr):
    """The maximum of the tokens ``start..end``, the smallest finite one and how many are finite."""
    row_max = float("-inf")
    row_min = float("inf")
    count = tl.zeros([BLOCK], dtype=tl.float32)
    for block_start in range(start, end, BLOCK):
        x = _load_row(row_ptr, block_start + tl.arange(0, BLOCK), end, scale, float("-inf"))
        finite = x > float("-inf")
        row_max = tl.maximum(row_max, tl.max(x, 0))
        row_min = tl.minimum(row_min, tl.min(tl.where(finite, x, float("inf")), 0))
        count += finite.to(tl.float32)
    return row_max, row_min, tl.sum(count, 0)


@triton.jit
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """``PIVOTS`` ascending values that cut ``(lo, hi]`` evenly, the first ``lo`` itself."""
    return lo + (hi - lo) * (tl.arange(0, PIVOTS).to(tl.float32) / PIVOTS)


@triton.jit
def _above_pivots(row_ptr, start, end, scale, floor, row_max, pivots, hi, SEARCH_BLOCK: tl.constexpr,
                  PIVOTS: tl.constexpr, BY_COUNT: tl.constexpr):
    """Of the tokens ``start..end``: the weight (``_weight``) and the number above each of the
    ascending ``pivots`` and at most ``hi``, and the weight above ``hi``. The pivots' work is done only
    for blocks with a token in the bracket ``(pivots[0], hi]``."""
    lo = tl.min(pivots, 0)
    mass = tl.zeros([SEARCH_BLOCK, PIVOTS], dtype=tl.float32)
    count = tl.zeros([SEARCH_BLOCK, PIVOTS], dtype=tl.int32)
    mass_above_hi = tl.zeros([SEARCH_BLOCK], dtype=tl.float32)
    for block_start in range(start, end, SEARCH_BLOCK):
        x = _load_row(row_ptr, block_start + tl.arange(0, SEARCH_BLOCK), end, scale, floor)
        weight = _weight(x, row_max, BY_COUNT)
        above_hi = x > hi
        mass_above_hi += tl.where(above_hi, weight, 0.0)
        at_most_hi = tl.where(above_hi, float("-inf"), x)
        if tl.max(at_most_hi, 0) > lo:
            above = at_most_hi[:, None] > pivots[None, :]
            mass += tl.where(above, weight[:, None], 0.0)
            count += above.to(tl.int32)
    return tl.sum(mass, 0), tl.sum(count, 0), tl.sum(mass_above_hi, 0)


@triton.jit
def _pick(values, index, PIVOTS: tl.constexpr):
    """``values[index]`` of a vector of ``PIVOTS``."""
    return tl.sum(tl.where(tl.arange(0, PIVOTS) == index, values, 0), 0)


@triton.jit
def _next_bracket(mass_inside, count_inside, mass_above_hi, total, limit, pivots, hi, PIVOTS: tl.constexpr):
    """From a cutting pass's sums over a row (``_above_pivots``'s): the piece of ``(pivots[0], hi]``
    that holds the threshold, ``(new_lo, new_hi]``, the weight above ``new_hi``, the number of tokens
    in the piece, and the index of the pivot ``new_hi`` (``PIVOTS`` when it is ``hi``)."""
    # The weight above a pivot falls as the pivot rises: pivots [0, last] have too much (pivots[0],
    # lo, has by the bracket's bound).
    mass = mass_inside + mass_above_hi
    last = tl.maximum(tl.sum((mass / total > limit).to(tl.int32), 0) - 1, 0)
    below_hi = last + 1 < PIVOTS
    new_lo = _pick(pivots, last, PIVOTS)
    new_hi = tl.where(below_hi, _pick(pivots, last + 1, PIVOTS), hi)
    new_mass_above_hi = tl.where(below_hi, _pick(mass, last + 1, PIVOTS), mass_above_hi)
    inside = _pick(count_inside, last, PIVOTS) - tl.where(below_hi, _pick(count_inside, last + 1, PIVOTS), 0)
    return new_lo, new_hi, new_mass_above_hi, inside, last + 1


@triton.jit
def _gather(row_ptr, start, end, scale, floor, lo, hi, scratch_row, offset, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Store the tokens of ``start..end`` inside ``(lo, hi]`` at ``scratch_row[offset:]``, in order,
    as far as ``CAP``; return the offset after them."""
    for block_start in range(start, end, BLOCK):
        x = _load_row(row_ptr, block_start + tl.arange(0, BLOCK), end, scale, floor)
        inside = (x > lo) & (x <= hi)
        position = offset + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(scratch_row + position, x, mask=inside & (position < CAP))
        offset += tl.sum(inside.to(tl.int32), 0)
    return offset


@triton.jit
def _chunk_sums_kernel(chunk_max_ptr, chunk_sum_ptr, chunk_min_ptr, logits_ptr, logits_stride, scale_ptr, floor_ptr,
                       limit_ptr, vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       BY_COUNT: tl.constexpr):
    """A chunk's maximum and sum of ``exp(x - max)``, or (top-k) its maximum, number of finite tokens
    and smallest finite token."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if _active(tl.load(limit_ptr + row), BY_COUNT):
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, vocab_size)
        row_ptr = logits_ptr + row * logits_stride
        part = row * num_chunks + chunk
        if BY_COUNT:
            chunk_max, chunk_min, chunk_sum = _max_min_count(row_ptr, start, end, tl.load(scale_ptr + row), BLOCK)
            tl.store(chunk_min_ptr + part, chunk_min)
        else:
            chunk_max, chunk_sum = _max_and_sum(row_ptr, start, end, tl.load(scale_ptr + row),
                                                tl.load(floor_ptr + row), BLOCK)
        tl.store(chunk_max_ptr + part, chunk_max)
        tl.store(chunk_sum_ptr + part, chunk_sum)


@triton.jit
def _first_bracket_kernel(phase_ptr, row_max_ptr, total_ptr, pivots_ptr, hi_ptr, base_ptr, length_ptr, chunk_max_ptr,
                          chunk_sum_ptr, chunk_min_ptr, limit_ptr, vocab_size, num_chunks, CHUNKS: tl.constexpr,
                          PIVOTS: tl.constexpr, BY_COUNT: tl.constexpr):
    """A row's maximum and Z from its chunks' (added in chunk order), and its first bracket's pivots;
    the first cut reads the whole row."""
    row = tl.program_id(0)
    phase = _NO_THRESHOLD
    limit = tl.load(limit_ptr + row)
    if _active(limit, BY_COUNT):
        chunks = tl.arange(0, CHUNKS)
        in_row = chunks < num_chunks
        chunk_max = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=in_row, other=float("-inf"))
        row_max = tl.max(chunk_max, 0)
        chunk_sum = tl.load(chunk_sum_ptr + row * num_chunks + chunks, mask=in_row, other=0.0)
        if BY_COUNT:
            # Just below the smallest finite token (by more than its rounding); with fewer than k finite
            # tokens the k-th is -inf, and every token stays.
            row_min = tl.min(tl.load(chunk_min_ptr + row * num_chunks + chunks, mask=in_row, other=float("inf")), 0)
            lo = row_min - 1.0 - tl.abs(row_min) * 1e-6
            total = 1.0
            searched = tl.sum(chunk_sum, 0) > limit
        else:
            total = tl.sum(tl.where(chunk_max > float("-inf"), chunk_sum * tl.exp(chunk_max - row_max), 0.0), 0)
            lo = row_max + tl.log((1 - limit) * total / vocab_size) - 1.0
            searched = row_max > float("-inf")
        if searched:
            phase = _CUTTING
            tl.store(row_max_ptr + row, row_max)
            tl.store(total_ptr + row, total)
            tl.store(pivots_ptr + row * PIVOTS + tl.arange(0, PIVOTS), _pivots(lo, row_max, PIVOTS))
            tl.store(hi_ptr + row, row_max)
            tl.store(base_ptr + row, 0.0)
            tl.store(length_ptr + row, vocab_size)
    tl.store(phase_ptr + row, phase)


@triton.jit
def _cut_kernel(part_mass_ptr, part_count_ptr, part_mass_hi_ptr, phase_ptr, row_max_ptr, pivots_ptr, hi_ptr, length_ptr,
                tokens_ptr, tokens_stride, scale_ptr, floor_ptr, num_chunks, CHUNK: tl.constexpr,
                SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr, BY_COUNT: tl.constexpr):
    """A chunk's share of a cutting pass over a row's tokens (the logits, or the bracket's tokens
    once gathered), for a row still cutting. The pivots come from memory, so that this pass and the
    row's cut compare with the very same values."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * CHUNK
    length = tl.load(length_ptr + row)
    if (tl.load(phase_ptr + row) == _CUTTING) & (start < length):
        lanes = tl.arange(0, PIVOTS)
        mass, count, mass_hi = _above_pivots(
            tokens_ptr + row * tokens_stride, start, tl.minimum(start + CHUNK, length), tl.load(scale_ptr + row),
            tl.load(floor_ptr + row), tl.load(row_max_ptr + row), tl.load(pivots_ptr + row * PIVOTS + lanes),
            tl.load(hi_ptr + row), SEARCH_BLOCK, PIVOTS, BY_COUNT)
        part = row * num_chunks + chunk
        tl.store(part_mass_ptr + part * PIVOTS + lanes, mass)
        tl.store(part_count_ptr + part * PIVOTS + lanes, count)
        tl.store(part_mass_hi_ptr + part, mass_hi)


@triton.jit
def _narrow_kernel(phase_ptr, pivots_ptr, hi_ptr, mass_above_hi_ptr, count_inside_ptr, hi_index_ptr, total_ptr,
                   base_ptr, length_ptr, limit_ptr, part_mass_ptr, part_count_ptr, part_mass_hi_ptr, num_chunks,
                   CAP: tl.constexpr, CHUNK: tl.constexpr, PIVOTS: tl.constexpr, CHUNKS: tl.constexpr):
    """A row's cut from its chunks' sums (added in chunk order; the mass above the gathered tokens,
    ``base``, first): the next bracket, and whether to cut it on or to gather it."""
    row = tl.program_id(0)
    if tl.load(phase_ptr + row) == _CUTTING:
        lanes = tl.arange(0, PIVOTS)
        chunks = tl.arange(0, CHUNKS)
        in_row = chunks * CHUNK < tl.load(length_ptr + row)
        parts = row * num_chunks + chunks
        tile = parts[:, None] * PIVOTS + lanes[None, :]
        mass = tl.sum(tl.load(part_mass_ptr + tile, mask=in_row[:, None], other=0.0), 0)
        count = tl.sum(tl.load(part_count_ptr + tile, mask=in_row[:, None], other=0), 0)
        mass_hi = tl.load(base_ptr + row) + tl.sum(tl.load(part_mass_hi_ptr + parts, mask=in_row, other=0.0), 0)
        pivots = tl.load(pivots_ptr + row * PIVOTS + lanes)
        lo = tl.min(pivots, 0)
        hi = tl.load(hi_ptr + row)
        new_lo, new_hi, new_mass_above_hi, inside, hi_index = _next_bracket(
            mass, count, mass_hi, tl.load(total_ptr + row), tl.load(limit_ptr + row), pivots, hi, PIVOTS)
        # Gather when the bracket fits, or when no pivot fell inside it: then it is one value wide,
        # every token in it equal to hi.
        cut = (inside > CAP) & ((new_lo != lo) | (new_hi != hi))
        tl.store(phase_ptr + row, tl.where(cut, _CUTTING, _GATHERING))
        tl.store(pivots_ptr + row * PIVOTS + lanes, _pivots(new_lo, new_hi, PIVOTS))
        tl.store(hi_ptr + row, new_hi)
        tl.store(mass_above_hi_ptr + row, new_mass_above_hi)
        tl.store(count_inside_ptr + row, inside)
        tl.store(hi_index_ptr + row, hi_index)


@triton.jit
def _compact_kernel(bracket_ptr, phase_ptr, pivots_ptr, hi_ptr, hi_index_ptr, count_inside_ptr, mass_above_hi_ptr,
                    base_ptr, length_ptr, part_count_ptr, logits_ptr, logits_stride, scale_ptr, floor_ptr, vocab_size,
                    num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CHUNKS: tl.constexpr):
    """A chunk's tokens in its row's bracket after the first cut, stored in ``bracket`` after those of
    the chunks before it (the cut's counts give each chunk its number of them): the later passes read
    these alone, with the mass above them as their base."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(phase_ptr + row) != _NO_THRESHOLD:
        hi_index = tl.load(hi_index_ptr + row)
        chunks = tl.arange(0, CHUNKS)
        earlier = chunks < chunk
        counts = part_count_ptr + (row * num_chunks + chunks) * PIVOTS
        above_lo = tl.load(counts + hi_index - 1, mask=earlier, other=0)
        above_hi = tl.load(counts + hi_index, mask=earlier & (hi_index < PIVOTS), other=0)
        start = chunk * CHUNK
        _gather(logits_ptr + row * logits_stride, start, tl.minimum(start + CHUNK, vocab_size),
                tl.load(scale_ptr + row), tl.load(floor_ptr + row), tl.load(pivots_ptr + row * PIVOTS), tl.load(hi_ptr + row),
                bracket_ptr + row * vocab_size, tl.sum(above_lo - above_hi, 0), vocab_size, BLOCK)
        if chunk == 0:
            tl.store(length_ptr + row, tl.load(count_inside_ptr + row))
            tl.store(base_ptr + row, tl.load(mass_above_hi_ptr + row))


@triton.jit
def _threshold_kernel(threshold_ptr, scratch_ptr, phase_ptr, row_max_ptr, total_ptr, pivots_ptr, hi_ptr,
                      mass_above_hi_ptr, base_ptr, length_ptr, limit_ptr, bracket_ptr, vocab_size, BLOCK: tl.constexpr,
                      SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CAP: tl.constexpr, COMPARE: tl.constexpr,
                      MAX_PASSES: tl.constexpr, BY_COUNT: tl.constexpr):
    """A row's threshold: its gathered tokens still in its bracket, taken in order (a row still too
    full is cut on first, over those tokens), each with the weight above it."""
    row = tl.program_id(0).to(tl.int64)
    phase = tl.load(phase_ptr + row)
    threshold = float("-inf")
    if phase != _NO_THRESHOLD:
        bracket_row = bracket_ptr + row * vocab_size
        length = tl.load(length_ptr + row)
        scratch_row = scratch_ptr + row * CAP
        row_max = tl.load(row_max_ptr + row)
        total = tl.load(total_ptr + row)
        limit = tl.load(limit_ptr + row)
        lo = tl.load(pivots_ptr + row * PIVOTS)  # the bracket's lower end is its first pivot
        hi = tl.load(hi_ptr + row)
        mass_above_hi = tl.load(mass_above_hi_ptr + row)
        if phase == _CUTTING:
            pivots = tl.load(pivots_ptr + row * PIVOTS + tl.arange(0, PIVOTS))
            base = tl.load(base_ptr + row)
            cut = True
            passes = 0
            while cut:
                mass, count, mass_hi = _above_pivots(bracket_row, 0, length, 1.0, float("-inf"), row_max, pivots, hi,
                                                     SEARCH_BLOCK, PIVOTS, BY_COUNT)
                new_lo, new_hi, mass_above_hi, inside, hi_index = _next_bracket(mass, count, base + mass_hi, total,
                                                                                limit, pivots, hi, PIVOTS)
                # The bound only keeps a row with a NaN logit from looping.
                passes += 1
                cut = (inside > CAP) & ((new_lo != lo) | (new_hi != hi)) & (passes < MAX_PASSES)
                lo = new_lo
                hi = new_hi
                pivots = _pivots(lo, hi, PIVOTS)
        gathered = tl.minimum(_gather(bracket_row, 0, length, 1.0, float("-inf"), lo, hi, scratch_row,
                                      tl.full([], 0, tl.int32), CAP, BLOCK), CAP)
        # The weight above each gathered token: the weight above the bracket, plus that of the gathered
        # tokens larger than it, read back COMPARE at a time.
        slots = tl.arange(0, CAP)
        candidates = tl.load(scratch_row + slots, mask=slots < gathered, other=float("-inf"))
        mass_above = tl.zeros([CAP], dtype=tl.float32) + mass_above_hi
        for start in range(0, gathered, COMPARE):
            others = start + tl.arange(0, COMPARE)
            other = tl.load(scratch_row + others, mask=others < gathered, other=float("-inf"))
            larger = other[None, :] > candidates[:, None]
            mass_above += tl.sum(tl.where(larger, _weight(other, row_max, BY_COUNT)[None, :], 0.0), 1)
        kept = (slots < gathered) & (mass_above / total <= limit)
        threshold = tl.min(tl.where(kept, candidates, float("inf")), 0)
    tl.store(threshold_ptr + row, threshold)


def top_k_top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                          inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's top-k / top-p threshold, float32 [n, 1], of ``logits`` [n, vocab] times the row's
    ``inverse_temperature`` [n] (or as they are), as ``sampler.top_k_top_p_threshold`` defines it:
    the tokens at least as large are kept (-inf: every token). ``top_k`` [n] (0: off) and ``top_p``
    [n] (1: off) are None when no row uses them."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    scale = (torch.ones(len(logits), dtype=torch.float32, device=logits.device) if inverse_temperature is None
             else inverse_temperature.to(torch.float32))
    threshold = torch.full_like(scale, float("-inf"))
    if top_k is not None:
        threshold = _search(logits, top_k.to(torch.float32) - 1, scale, threshold, by_count=True)
    if top_p is not None:
        # Over the top-k set alone: its tokens hold the mass that top-p shares out.
        threshold = torch.maximum(threshold, _search(logits, top_p.to(torch.float32), scale, threshold,
                                                     by_count=False))
    return threshold.unsqueeze(-1)


def _search(logits: torch.Tensor, limit: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor,
            by_count: bool) -> torch.Tensor:
    """Each row's smallest logit (times ``scale``, -inf below ``floor``) whose weight above is at most
    ``limit`` [n]: a count (top-k's ``k - 1``) or a share of the mass (top-p); -inf for a row whose
    filter is off, or which has nothing to cut."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    chunk = min(_CHUNK, triton.next_power_of_2(vocab_size))
    num_chunks = triton.cdiv(vocab_size, chunk)
    block = min(_BLOCK, chunk)
    search_block = min(_SEARCH_BLOCK, chunk)
    chunks = triton.next_power_of_2(num_chunks)

    def floats(*shape):
        return torch.empty(shape, dtype=torch.float32, device=device)

    def ints(*shape):
        return torch.empty(shape, dtype=torch.int32, device=device)

    threshold = floats(num_rows)
    if not num_rows:
        return threshold
    # Per row: what its program does next, its maximum and Z, its bracket's pivots (the first is its
    # lower end) and upper end hi, the weight above hi, the tokens inside and which pivot of the last
    # cut hi is, and the tokens a cut reads (the row's, then those gathered) with the weight above them.
    phase, count_inside, hi_index, length = (ints(num_rows) for _ in range(4))
    row_max, total, hi, mass_above_hi, base = (floats(num_rows) for _ in range(5))
    pivots = floats(num_rows, _PIVOTS)
    chunk_max, chunk_sum, chunk_min, part_mass_hi = (floats(num_rows, num_chunks) for _ in range(4))
    part_mass, part_count = floats(num_rows, num_chunks, _PIVOTS), ints(num_rows, num_chunks, _PIVOTS)
    bracket = floats(num_rows, vocab_size)
    scratch = floats(num_rows, _CAP)
    rows_by_chunks = (num_rows, num_chunks)

    def cut(tokens: torch.Tensor, tokens_scale: torch.Tensor, tokens_floor: torch.Tensor) -> None:
        _cut_kernel[rows_by_chunks](part_mass, part_count, part_mass_hi, phase, row_max, pivots, hi, length, tokens,
                                    tokens.stride(0), tokens_scale, tokens_floor, num_chunks, CHUNK=chunk,
                                    SEARCH_BLOCK=search_block, PIVOTS=_PIVOTS, BY_COUNT=by_count)
        _narrow_kernel[(num_rows,)](phase, pivots, hi, mass_above_hi, count_inside, hi_index, total, base, length,
                                    limit, part_mass, part_count, part_mass_hi, num_chunks, CAP=_CAP, CHUNK=chunk,
                                    PIVOTS=_PIVOTS, CHUNKS=chunks)

    _chunk_sums_kernel[rows_by_chunks](chunk_max, chunk_sum, chunk_min, logits, logits.stride(0), scale, floor, limit,
                                       vocab_size, num_chunks, CHUNK=chunk, BLOCK=block, BY_COUNT=by_count)
    _first_bracket_kernel[(num_rows,)](phase, row_max, total, pivots, hi, base, length, chunk_max, chunk_sum, chunk_min,
                                       limit, vocab_size, num_chunks, CHUNKS=chunks, PIVOTS=_PIVOTS, BY_COUNT=by_count)
    cut(logits, scale, floor)
    _compact_kernel[rows_by_chunks](bracket, phase, pivots, hi, hi_index, count_inside, mass_above_hi, base, length,
                                    part_count, logits, logits.stride(0), scale, floor, vocab_size, num_chunks,
                                    CHUNK=chunk, BLOCK=block, PIVOTS=_PIVOTS, CHUNKS=chunks)
    # The gathered tokens are scaled, and at least their floor, already.
    as_gathered, no_floor = torch.ones_like(scale), torch.full_like(floor, float("-inf"))
    for _ in range(_PARALLEL_PASSES):
        cut(bracket, as_gathered, no_floor)
    _threshold_kernel[(num_rows,)](threshold, scratch, phase, row_max, total, pivots, hi, mass_above_hi, base,
                                   length, limit, bracket, vocab_size, BLOCK=block, SEARCH_BLOCK=search_block,
                                   PIVOTS=_PIVOTS, CAP=_CAP, COMPARE=_COMPARE, MAX_PASSES=_MAX_PASSES,
                                   BY_COUNT=by_count)
    return threshold
