"""The top-p threshold of whole rows on CUDA, without sorting them, in passes spread over the GPU.

A row with top-p and no top-k keeps the tokens whose probability strictly above them is at most
``top_p`` (``sampler.top_k_top_p_threshold``): the tokens at least as large as the threshold ``t``,
the smallest logit of the row with ``mass(x > t) <= top_p``. The sort-based definition
(``sampler.sorted_top_p_threshold``) sorts 151,936 logits a row; this finds the same logit in a few
reading passes. A pass over a row is cut into chunks (one program per row and chunk), so that every
SM reads at any batch size, and a small program per row joins the chunks' sums:

1. each chunk's maximum and sum of ``exp(x - max)``; from them the row's maximum ``m`` and ``Z``;
2. the threshold lies in the bracket ``(lo, m]`` with ``lo = m + ln((1 - top_p) * Z / V) - 1``:
   tokens below ``m + ln((1 - top_p) * Z / V)`` hold less than ``1 - top_p`` of the mass together,
   so the mass above any of them exceeds ``top_p`` and all of them are dropped (the 1 is a margin
   for rounding);
3. a cut: each chunk sums the mass and counts the tokens above each of ``PIVOTS`` evenly spaced
   values of the bracket, and the row keeps the piece in which the mass above crosses ``top_p``;
4. the piece's tokens are gathered, in row order (each chunk at the offset the cut's counts give it),
   and the mass above them kept: the later cuts read these alone, a few thousand tokens where a
   flat row (a random model's) holds most of its 151,936 in the first bracket;
5. more cuts (``PARALLEL_PASSES``, a row that is done skips the rest), until the bracket holds at
   most ``CAP`` tokens, or it cannot be cut (it is one value wide);
6. per row, the bracket's tokens in order; the mass above each is the mass above the bracket plus
   that of the others larger than it, and the threshold is the smallest whose mass above is at most
   ``top_p`` (a tie is kept or dropped as one, as the sorted definition keeps it). A row still too
   full after the cuts of step 5 (thousands of distinct logits within a hair of each other) is cut
   on here first, by its own program.

The logits are read times each row's inverse temperature when one is given, the same product as the
Sampler's ``logits * (1 / T)``, so that a row with top-p alone needs no scaled copy of its logits.
Every sum is a fixed-order sum over the row's own tokens, so a row's threshold does not depend on
its batch; it can differ from the sorted definition's only where a token's mass above lies within
fp32 rounding of ``top_p`` (the sums add the same terms in another order).
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
def _load_row(row_ptr, cols, end, scale):
    """The tokens ``cols`` before ``end``, in fp32 times ``scale`` (-inf past ``end``): the product
    is the Sampler's own ``logits * (1 / T)``."""
    return tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * scale


@triton.jit
def _max_and_sum(row_ptr, start, end, scale, BLOCK: tl.constexpr):
    """The maximum of the tokens ``start..end`` and the sum of ``exp(x - max)`` (online: per lane,
    rescaled once per block)."""
    row_max = float("-inf")
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for block_start in range(start, end, BLOCK):
        x = _load_row(row_ptr, block_start + tl.arange(0, BLOCK), end, scale)
        new_max = tl.maximum(row_max, tl.max(x, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf block adds exp(-inf) = 0
        total = total * tl.exp(row_max - shift) + tl.exp(x - shift)
        row_max = new_max
    return row_max, tl.sum(total, 0)


@triton.jit
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """``PIVOTS`` ascending values that cut ``(lo, hi]`` evenly, the first ``lo`` itself."""
    return lo + (hi - lo) * (tl.arange(0, PIVOTS).to(tl.float32) / PIVOTS)


@triton.jit
def _above_pivots(row_ptr, start, end, scale, row_max, pivots, hi, SEARCH_BLOCK: tl.constexpr,
                  PIVOTS: tl.constexpr):
    """Of the tokens ``start..end``: the mass (relative to ``exp(row_max)``) and the number above each
    of the ascending ``pivots`` and at most ``hi``, and the mass above ``hi``. The pivots' work is done
    only for blocks with a token in the bracket ``(pivots[0], hi]``."""
    lo = tl.min(pivots, 0)
    mass = tl.zeros([SEARCH_BLOCK, PIVOTS], dtype=tl.float32)
    count = tl.zeros([SEARCH_BLOCK, PIVOTS], dtype=tl.int32)
    mass_above_hi = tl.zeros([SEARCH_BLOCK], dtype=tl.float32)
    for block_start in range(start, end, SEARCH_BLOCK):
        x = _load_row(row_ptr, block_start + tl.arange(0, SEARCH_BLOCK), end, scale)
        weight = tl.exp(x - row_max)
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
def _next_bracket(mass_inside, count_inside, mass_above_hi, total, top_p, pivots, hi, PIVOTS: tl.constexpr):
    """From a cutting pass's sums over a row (``_above_pivots``'s): the piece of ``(pivots[0], hi]``
    that holds the threshold, ``(new_lo, new_hi]``, the mass above ``new_hi``, the number of tokens in
    the piece, and the index of the pivot ``new_hi`` (``PIVOTS`` when it is ``hi``)."""
    # The mass above a pivot falls as the pivot rises: pivots [0, last] have too much (pivots[0], lo,
    # has by the bracket's bound).
    mass = mass_inside + mass_above_hi
    last = tl.maximum(tl.sum((mass / total > top_p).to(tl.int32), 0) - 1, 0)
    below_hi = last + 1 < PIVOTS
    new_lo = _pick(pivots, last, PIVOTS)
    new_hi = tl.where(below_hi, _pick(pivots, last + 1, PIVOTS), hi)
    new_mass_above_hi = tl.where(below_hi, _pick(mass, last + 1, PIVOTS), mass_above_hi)
    inside = _pick(count_inside, last, PIVOTS) - tl.where(below_hi, _pick(count_inside, last + 1, PIVOTS), 0)
    return new_lo, new_hi, new_mass_above_hi, inside, last + 1


@triton.jit
def _gather(row_ptr, start, end, scale, lo, hi, scratch_row, offset, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Store the tokens of ``start..end`` inside ``(lo, hi]`` at ``scratch_row[offset:]``, in order,
    as far as ``CAP``; return the offset after them."""
    for block_start in range(start, end, BLOCK):
        x = _load_row(row_ptr, block_start + tl.arange(0, BLOCK), end, scale)
        inside = (x > lo) & (x <= hi)
        position = offset + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(scratch_row + position, x, mask=inside & (position < CAP))
        offset += tl.sum(inside.to(tl.int32), 0)
    return offset


@triton.jit
def _chunk_max_sum_kernel(chunk_max_ptr, chunk_sum_ptr, logits_ptr, logits_stride, scale_ptr, top_p_ptr, vocab_size,
                          num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(top_p_ptr + row) < 1:
        start = chunk * CHUNK
        chunk_max, chunk_sum = _max_and_sum(logits_ptr + row * logits_stride, start,
                                            tl.minimum(start + CHUNK, vocab_size), tl.load(scale_ptr + row), BLOCK)
        tl.store(chunk_max_ptr + row * num_chunks + chunk, chunk_max)
        tl.store(chunk_sum_ptr + row * num_chunks + chunk, chunk_sum)


@triton.jit
def _first_bracket_kernel(phase_ptr, row_max_ptr, total_ptr, pivots_ptr, hi_ptr, base_ptr, length_ptr, chunk_max_ptr,
                          chunk_sum_ptr, top_p_ptr, vocab_size, num_chunks, CHUNKS: tl.constexpr, PIVOTS: tl.constexpr):
    """A row's maximum and Z from its chunks' (added in chunk order), and its first bracket's pivots;
    the first cut reads the whole row."""
    row = tl.program_id(0)
    phase = _NO_THRESHOLD
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1:
        chunks = tl.arange(0, CHUNKS)
        in_row = chunks < num_chunks
        chunk_max = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=in_row, other=float("-inf"))
        row_max = tl.max(chunk_max, 0)
        if row_max > float("-inf"):
            chunk_sum = tl.load(chunk_sum_ptr + row * num_chunks + chunks, mask=in_row, other=0.0)
            total = tl.sum(tl.where(chunk_max > float("-inf"), chunk_sum * tl.exp(chunk_max - row_max), 0.0), 0)
            lo = row_max + tl.log((1 - top_p) * total / vocab_size) - 1.0
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
                tokens_ptr, tokens_stride, scale_ptr, num_chunks, CHUNK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                PIVOTS: tl.constexpr):
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
            tl.load(row_max_ptr + row), tl.load(pivots_ptr + row * PIVOTS + lanes), tl.load(hi_ptr + row),
            SEARCH_BLOCK, PIVOTS)
        part = row * num_chunks + chunk
        tl.store(part_mass_ptr + part * PIVOTS + lanes, mass)
        tl.store(part_count_ptr + part * PIVOTS + lanes, count)
        tl.store(part_mass_hi_ptr + part, mass_hi)


@triton.jit
def _narrow_kernel(phase_ptr, pivots_ptr, hi_ptr, mass_above_hi_ptr, count_inside_ptr, hi_index_ptr, total_ptr,
                   base_ptr, length_ptr, top_p_ptr, part_mass_ptr, part_count_ptr, part_mass_hi_ptr, num_chunks,
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
            mass, count, mass_hi, tl.load(total_ptr + row), tl.load(top_p_ptr + row), pivots, hi, PIVOTS)
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
                    base_ptr, length_ptr, part_count_ptr, logits_ptr, logits_stride, scale_ptr, vocab_size, num_chunks,
                    CHUNK: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CHUNKS: tl.constexpr):
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
                tl.load(scale_ptr + row), tl.load(pivots_ptr + row * PIVOTS), tl.load(hi_ptr + row),
                bracket_ptr + row * vocab_size, tl.sum(above_lo - above_hi, 0), vocab_size, BLOCK)
        if chunk == 0:
            tl.store(length_ptr + row, tl.load(count_inside_ptr + row))
            tl.store(base_ptr + row, tl.load(mass_above_hi_ptr + row))


@triton.jit
def _threshold_kernel(threshold_ptr, scratch_ptr, phase_ptr, row_max_ptr, total_ptr, pivots_ptr, hi_ptr,
                      mass_above_hi_ptr, base_ptr, length_ptr, top_p_ptr, bracket_ptr, vocab_size, BLOCK: tl.constexpr,
                      SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CAP: tl.constexpr, COMPARE: tl.constexpr,
                      MAX_PASSES: tl.constexpr):
    """A row's threshold: its gathered tokens still in its bracket, taken in order (a row still too
    full is cut on first, over those tokens), each with the mass above it."""
    row = tl.program_id(0).to(tl.int64)
    phase = tl.load(phase_ptr + row)
    threshold = float("-inf")
    if phase != _NO_THRESHOLD:
        bracket_row = bracket_ptr + row * vocab_size
        length = tl.load(length_ptr + row)
        scratch_row = scratch_ptr + row * CAP
        row_max = tl.load(row_max_ptr + row)
        total = tl.load(total_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        lo = tl.load(pivots_ptr + row * PIVOTS)  # the bracket's lower end is its first pivot
        hi = tl.load(hi_ptr + row)
        mass_above_hi = tl.load(mass_above_hi_ptr + row)
        if phase == _CUTTING:
            pivots = tl.load(pivots_ptr + row * PIVOTS + tl.arange(0, PIVOTS))
            base = tl.load(base_ptr + row)
            cut = True
            passes = 0
            while cut:
                mass, count, mass_hi = _above_pivots(bracket_row, 0, length, 1.0, row_max, pivots, hi, SEARCH_BLOCK,
                                                     PIVOTS)
                new_lo, new_hi, mass_above_hi, inside, hi_index = _next_bracket(mass, count, base + mass_hi, total,
                                                                                top_p, pivots, hi, PIVOTS)
                # The bound only keeps a row with a NaN logit from looping.
                passes += 1
                cut = (inside > CAP) & ((new_lo != lo) | (new_hi != hi)) & (passes < MAX_PASSES)
                lo = new_lo
                hi = new_hi
                pivots = _pivots(lo, hi, PIVOTS)
        gathered = tl.minimum(_gather(bracket_row, 0, length, 1.0, lo, hi, scratch_row, tl.full([], 0, tl.int32),
                                      CAP, BLOCK), CAP)
        # The mass above each gathered token: the mass above the bracket, plus that of the gathered
        # tokens larger than it, read back COMPARE at a time.
        slots = tl.arange(0, CAP)
        candidates = tl.load(scratch_row + slots, mask=slots < gathered, other=float("-inf"))
        mass_above = tl.zeros([CAP], dtype=tl.float32) + mass_above_hi
        for start in range(0, gathered, COMPARE):
            others = start + tl.arange(0, COMPARE)
            other = tl.load(scratch_row + others, mask=others < gathered, other=float("-inf"))
            larger = other[None, :] > candidates[:, None]
            mass_above += tl.sum(tl.where(larger, tl.exp(other - row_max)[None, :], 0.0), 1)
        kept = (slots < gathered) & (mass_above / total <= top_p)
        threshold = tl.min(tl.where(kept, candidates, float("inf")), 0)
    tl.store(threshold_ptr + row, threshold)


def top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor,
                    inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's top-p threshold over its whole row, float32 [n, 1], of the logits times the row's
    ``inverse_temperature`` (or as they are): the smallest whose mass above is at most ``top_p``
    (-inf where ``top_p`` is 1, or where the row is all -inf)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    device = logits.device
    top_p = top_p.to(torch.float32)
    scale = torch.ones_like(top_p) if inverse_temperature is None else inverse_temperature.to(torch.float32)
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
        return threshold.unsqueeze(-1)
    # Per row: what its program does next, its maximum and Z, its bracket's pivots (the first is its
    # lower end) and upper end hi, the mass above hi, the tokens inside and which pivot of the last cut
    # hi is, and the tokens a cut reads (the row's, then those gathered) with the mass above them.
    phase, count_inside, hi_index, length = (ints(num_rows) for _ in range(4))
    row_max, total, hi, mass_above_hi, base = (floats(num_rows) for _ in range(5))
    pivots = floats(num_rows, _PIVOTS)
    chunk_max, chunk_sum, part_mass_hi = (floats(num_rows, num_chunks) for _ in range(3))
    part_mass, part_count = floats(num_rows, num_chunks, _PIVOTS), ints(num_rows, num_chunks, _PIVOTS)
    bracket = floats(num_rows, vocab_size)
    scratch = floats(num_rows, _CAP)
    rows_by_chunks = (num_rows, num_chunks)

    def cut(tokens: torch.Tensor, tokens_scale: torch.Tensor) -> None:
        _cut_kernel[rows_by_chunks](part_mass, part_count, part_mass_hi, phase, row_max, pivots, hi, length, tokens,
                                    tokens.stride(0), tokens_scale, num_chunks, CHUNK=chunk, SEARCH_BLOCK=search_block,
                                    PIVOTS=_PIVOTS)
        _narrow_kernel[(num_rows,)](phase, pivots, hi, mass_above_hi, count_inside, hi_index, total, base, length,
                                    top_p, part_mass, part_count, part_mass_hi, num_chunks, CAP=_CAP, CHUNK=chunk,
                                    PIVOTS=_PIVOTS, CHUNKS=chunks)

    _chunk_max_sum_kernel[rows_by_chunks](chunk_max, chunk_sum, logits, logits.stride(0), scale, top_p, vocab_size,
                                          num_chunks, CHUNK=chunk, BLOCK=block)
    _first_bracket_kernel[(num_rows,)](phase, row_max, total, pivots, hi, base, length, chunk_max, chunk_sum, top_p,
                                       vocab_size, num_chunks, CHUNKS=chunks, PIVOTS=_PIVOTS)
    cut(logits, scale)
    _compact_kernel[rows_by_chunks](bracket, phase, pivots, hi, hi_index, count_inside, mass_above_hi, base, length,
                                    part_count, logits, logits.stride(0), scale, vocab_size, num_chunks, CHUNK=chunk,
                                    BLOCK=block, PIVOTS=_PIVOTS, CHUNKS=chunks)
    unscaled = torch.ones_like(top_p)  # the gathered tokens are scaled already
    for _ in range(_PARALLEL_PASSES):
        cut(bracket, unscaled)
    _threshold_kernel[(num_rows,)](threshold, scratch, phase, row_max, total, pivots, hi, mass_above_hi, base,
                                   length, top_p, bracket, vocab_size, BLOCK=block, SEARCH_BLOCK=search_block,
                                   PIVOTS=_PIVOTS, CAP=_CAP, COMPARE=_COMPARE, MAX_PASSES=_MAX_PASSES)
    return threshold.unsqueeze(-1)
