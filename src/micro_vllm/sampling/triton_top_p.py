"""The top-p threshold of whole rows on CUDA, without sorting them: one Triton program per row.

A row with top-p and no top-k keeps the tokens whose probability strictly above them is at most
``top_p`` (``sampler.apply_top_k_top_p``): the tokens at least as large as the threshold ``t``, the
smallest logit of the row with ``mass(x > t) <= top_p``. The sort-based definition
(``sampler.sorted_top_p_threshold``) sorts 151,936 logits a row; this finds the same logit in a few
reading passes:

1. the row's maximum ``m`` and ``Z``, the sum of ``exp(x - m)``;
2. the threshold lies in the bracket ``(lo, m]`` with ``lo = m + ln((1 - top_p) * Z / V) - 1``:
   tokens below ``m + ln((1 - top_p) * Z / V)`` hold less than ``1 - top_p`` of the mass together,
   so the mass above any of them exceeds ``top_p`` and all of them are dropped (the 1 is a margin
   for rounding);
3. passes that cut the bracket at ``PIVOTS`` evenly spaced values, take the mass and the number of
   tokens above each, and keep the piece in which the mass above crosses ``top_p``, until the
   bracket holds at most ``CAP`` tokens (or it cannot be cut: it is one value wide);
4. a pass that gathers the bracket's tokens; the mass above each is the mass above the bracket plus
   that of the gathered tokens larger than it, and the threshold is the smallest gathered token
   whose mass above is at most ``top_p`` (a tie is kept or dropped as one, as the sorted definition
   keeps it).

Every sum is a fixed-order sum over the row's own tokens, so a row's threshold does not depend on
its batch; it can differ from the sorted definition's only where a token's mass above lies within
fp32 rounding of ``top_p`` (the sums add the same terms in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # tokens per loop iteration of the maximum / sum and gathering passes
# The cutting passes keep per lane a sum and a count for each pivot ([SEARCH_BLOCK, PIVOTS] of each):
# 16 pivots shrink the bracket 16-fold a pass, within the registers of 4 warps.
_SEARCH_BLOCK = 256
_PIVOTS = 16
_CAP = 1024  # the most tokens the last pass gathers
_CHUNK = 8  # gathered tokens compared with all the others at a time
_MAX_PASSES = 40  # 16**40 = 2**160: more than any bracket of fp32 values needs to be one value wide


@triton.jit
def _load_row(row_ptr, cols, vocab_size):
    return tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)


@triton.jit
def _max_and_sum(row_ptr, vocab_size, BLOCK: tl.constexpr):
    """The row's maximum and the sum of ``exp(x - max)`` (online: per lane, rescaled once per block)."""
    row_max = float("-inf")
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        x = _load_row(row_ptr, start + tl.arange(0, BLOCK), vocab_size)
        new_max = tl.maximum(row_max, tl.max(x, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf block adds exp(-inf) = 0
        total = total * tl.exp(row_max - shift) + tl.exp(x - shift)
        row_max = new_max
    return row_max, tl.sum(total, 0)


@triton.jit
def _above_pivots(row_ptr, vocab_size, row_max, pivots, hi, SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """The mass (relative to ``exp(row_max)``) and the number of the row's tokens above each of the
    ascending ``pivots``, all at most ``hi``, and above ``hi``. The pivots' work is done only for
    blocks with a token in the bracket ``(pivots[0], hi]``; the tokens above it count once."""
    mass = tl.zeros([SEARCH_BLOCK, PIVOTS], dtype=tl.float32)
    count = tl.zeros([SEARCH_BLOCK, PIVOTS], dtype=tl.int32)
    mass_above_hi = tl.zeros([SEARCH_BLOCK], dtype=tl.float32)
    count_above_hi = tl.zeros([SEARCH_BLOCK], dtype=tl.int32)
    lo = tl.min(pivots, 0)
    for start in range(0, vocab_size, SEARCH_BLOCK):
        x = _load_row(row_ptr, start + tl.arange(0, SEARCH_BLOCK), vocab_size)
        weight = tl.exp(x - row_max)
        above_hi = x > hi
        mass_above_hi += tl.where(above_hi, weight, 0.0)
        count_above_hi += above_hi.to(tl.int32)
        if tl.max(tl.where(above_hi, float("-inf"), x), 0) > lo:
            above = (x[:, None] > pivots[None, :]) & ~above_hi[:, None]
            mass += tl.where(above, weight[:, None], 0.0)
            count += above.to(tl.int32)
    mass_above_hi = tl.sum(mass_above_hi, 0)
    count_above_hi = tl.sum(count_above_hi, 0)
    return mass_above_hi + tl.sum(mass, 0), count_above_hi + tl.sum(count, 0), mass_above_hi, count_above_hi


@triton.jit
def _pick(values, index, lanes):
    """``values[index]`` of a small vector."""
    return tl.sum(tl.where(lanes == index, values, 0), 0)


@triton.jit
def _top_p_threshold_kernel(threshold_ptr, logits_ptr, logits_stride, top_p_ptr, scratch_ptr, vocab_size,
                            BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                            CAP: tl.constexpr, CHUNK: tl.constexpr, MAX_PASSES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    top_p = tl.load(top_p_ptr + row)
    threshold = float("-inf")  # top-p off, or a row of -inf only: every token stays
    if top_p < 1:
        row_max, total = _max_and_sum(row_ptr, vocab_size, BLOCK)
        if row_max > float("-inf"):
            lo = row_max + tl.log((1 - top_p) * total / vocab_size) - 1.0
            hi = row_max
            mass_above_hi = 0.0  # the mass of the tokens above hi, relative to exp(row_max)
            lanes = tl.arange(0, PIVOTS)
            cut = True
            passes = 0
            while cut:
                pivots = lo + (hi - lo) * (lanes.to(tl.float32) / PIVOTS)  # pivots[0] == lo
                mass, count, mass_hi, count_hi = _above_pivots(row_ptr, vocab_size, row_max, pivots, hi,
                                                               SEARCH_BLOCK, PIVOTS)
                # The mass above a pivot falls as the pivot rises: pivots [0, last] have too much
                # (pivots[0], lo, has by the bracket's bound). The new bracket is (pivots[last], the
                # next pivot or hi].
                last = tl.maximum(tl.sum((mass / total > top_p).to(tl.int32), 0) - 1, 0)
                below_hi = last + 1 < PIVOTS
                new_lo = _pick(pivots, last, lanes)
                new_hi = tl.where(below_hi, _pick(pivots, last + 1, lanes), hi)
                mass_above_hi = tl.where(below_hi, _pick(mass, last + 1, lanes), mass_hi)
                count_inside = _pick(count, last, lanes) - tl.where(below_hi, _pick(count, last + 1, lanes), count_hi)
                # Stop when the gathering pass can take the bracket, or when no pivot fell inside it:
                # then it is one value wide, every token in it equal to hi. MAX_PASSES cuts shrink
                # any bracket of fp32 values to one value; the bound only keeps a row with a NaN
                # logit from looping.
                passes += 1
                cut = (count_inside > CAP) & ((new_lo != lo) | (new_hi != hi)) & (passes < MAX_PASSES)
                lo = new_lo
                hi = new_hi
            # Gather the bracket's tokens (the first CAP, when more are all equal to hi).
            scratch_row = scratch_ptr + row * CAP
            gathered = 0
            for start in range(0, vocab_size, BLOCK):
                x = _load_row(row_ptr, start + tl.arange(0, BLOCK), vocab_size)
                inside = (x > lo) & (x <= hi)
                position = gathered + tl.cumsum(inside.to(tl.int32), 0) - 1
                tl.store(scratch_row + position, x, mask=inside & (position < CAP))
                gathered += tl.sum(inside.to(tl.int32), 0)
            # The mass above each gathered token: the mass above the bracket, plus that of the
            # gathered tokens larger than it, read back CHUNK at a time.
            slots = tl.arange(0, CAP)
            candidates = tl.load(scratch_row + slots, mask=slots < gathered, other=float("-inf"))
            mass_above = tl.zeros([CAP], dtype=tl.float32) + mass_above_hi
            for start in range(0, tl.minimum(gathered, CAP), CHUNK):
                others = start + tl.arange(0, CHUNK)
                other = tl.load(scratch_row + others, mask=others < gathered, other=float("-inf"))
                larger = other[None, :] > candidates[:, None]
                mass_above += tl.sum(tl.where(larger, tl.exp(other - row_max)[None, :], 0.0), 1)
            kept = (slots < gathered) & (mass_above / total <= top_p)
            threshold = tl.min(tl.where(kept, candidates, float("inf")), 0)
    tl.store(threshold_ptr + row, threshold)


def top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p threshold over its whole row, float32 [n, 1]: the smallest logit whose mass
    above is at most ``top_p`` (-inf where ``top_p`` is 1, or where the row is all -inf)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    threshold = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    scratch = torch.empty(num_rows, _CAP, dtype=torch.float32, device=logits.device)
    if num_rows:
        _top_p_threshold_kernel[(num_rows,)](
            threshold, logits, logits.stride(0), top_p.to(torch.float32), scratch, vocab_size,
            BLOCK=min(_BLOCK, triton.next_power_of_2(vocab_size)),
            SEARCH_BLOCK=min(_SEARCH_BLOCK, triton.next_power_of_2(vocab_size)), PIVOTS=_PIVOTS, CAP=_CAP, CHUNK=_CHUNK,
            MAX_PASSES=_MAX_PASSES,
        )
    return threshold.unsqueeze(-1)
