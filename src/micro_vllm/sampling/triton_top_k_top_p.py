"""The threshold of rows with top-k and top-p on CUDA, from their top-k candidates, one program a row.

``sampler.top_k_top_p_threshold`` selects each row's best candidates with ``torch.topk`` (raw
logits, descending). The PyTorch definition of the threshold from them
(``sampler.top_k_top_p_of_candidates``) counts the tie at the k-th logit over the whole vocabulary
and finds top-p within the top-k set in a dozen small launches; this does the same in one, per row:

1. the k-th candidate ``kth`` (k clamped to the candidates), whose value times the row's inverse
   temperature (the Sampler's own fp32 product ``logits * (1 / T)``) is the top-k threshold;
2. how many candidates are above ``kth`` (they come first) and how many equal it (next). Only when
   the last candidate equals ``kth`` can the tie go on past the candidates (the other tokens are at
   most the last candidate); then, rarely, the row's logits are read to count it. The common row
   reads its candidates alone;
3. top-p within the top-k set, as the definition has it: the weights ``exp(x - best)`` of the
   candidates above ``kth``, and the tie counted as that many equal terms, make the total; a
   candidate is kept when the mass before it (its cumulative sum less its own weight, over the
   total) is at most ``top_p``; the tie, which adds nothing to the cumulative sum, is kept or
   dropped as one. The top-p threshold is the last kept candidate's scaled value, and the row's
   threshold the larger of the two.

The sums run over the row's candidates above its k-th alone, in blocks of a fixed ``_SCAN_BLOCK``
from the first: a block's sum, and a candidate's cumulative sum (the blocks before it, then a scan
of its own block, which combines only the candidates up to it), group the same terms the same way
whatever the number of candidates the batch took or its other rows, so a seeded request draws the
same tokens in any batch. The weights are ``expf`` (libdevice's, as PyTorch's CUDA kernels use), of
the same fp32 products and differences (no fused multiply-add), and the division is correctly
rounded: each term is PyTorch's on CUDA. The sums add them in another order than ``torch.cumsum``
(a scan on CUDA, in double precision on CPU), so a threshold can differ from the PyTorch
definition's only where a candidate's mass before it lies within fp32 rounding of ``top_p``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_BLOCK = 1024  # values per loop iteration of the counts: 8 per thread of 4 warps
# Candidates per block of the top-p sums, one per thread of 4 warps: a fixed width, so that the sums'
# grouping is the same in every batch.
_SCAN_BLOCK = 128


@triton.jit
def _count_from(row_ptr, end, value, BLOCK: tl.constexpr):
    """Of ``row[:end]``: how many are above ``value``, and how many equal it (compared in the row's
    own dtype)."""
    above = tl.zeros([BLOCK], dtype=tl.int32)
    equal = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < end
        x = tl.load(row_ptr + cols, mask=in_row)
        above += (in_row & (x > value)).to(tl.int32)
        equal += (in_row & (x == value)).to(tl.int32)
    return tl.sum(above, 0), tl.sum(equal, 0)


@triton.jit
def _weights(candidates_row, start, num_above, scale, best, SCAN_BLOCK: tl.constexpr):
    """The weights ``exp(x - best)`` of the scaled candidates ``start..start + SCAN_BLOCK``; 0 from
    ``num_above`` on (the tie at the k-th and below it)."""
    i = start + tl.arange(0, SCAN_BLOCK)
    above = i < num_above
    x = tl.load(candidates_row + i, mask=above).to(tl.float32) * scale
    return tl.where(above, libdevice.exp(x - best), 0.0)


# The candidate count follows the batch's largest top-k: one compiled kernel serves them all.
@triton.jit(do_not_specialize=["num_candidates"])
def _top_k_top_p_kernel(threshold_ptr, candidates_ptr, num_candidates, logits_ptr, logits_stride, vocab_size,
                        top_k_ptr, top_p_ptr, scale_ptr, BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    top_k = tl.load(top_k_ptr + row)
    threshold = float("-inf")
    if top_k > 0:
        scale = 1.0
        if scale_ptr is not None:
            scale = tl.load(scale_ptr + row)
        candidates_row = candidates_ptr + row * num_candidates
        kth = tl.load(candidates_row + tl.minimum(top_k, num_candidates) - 1)
        threshold = kth.to(tl.float32) * scale
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1:
            # The candidates above the k-th come first; those tied with it next.
            num_above, tied_candidates = _count_from(candidates_row, num_candidates, kth, BLOCK)
            num_tied = tied_candidates
            if tl.load(candidates_row + num_candidates - 1) == kth:
                num_tied = _count_from(logits_ptr + row * logits_stride, vocab_size, kth, BLOCK)[1]
            best = tl.load(candidates_row).to(tl.float32) * scale
            mass_above = 0.0
            for start in range(0, num_above, SCAN_BLOCK):
                mass_above += tl.sum(_weights(candidates_row, start, num_above, scale, best, SCAN_BLOCK), 0)
            total = mass_above + num_tied.to(tl.float32) * libdevice.exp(threshold - best)
            before_block = 0.0  # the mass of the blocks before, summed as mass_above is
            num_kept = 0
            for start in range(0, num_above, SCAN_BLOCK):
                weight = _weights(candidates_row, start, num_above, scale, best, SCAN_BLOCK)
                mass_before = tl.math.div_rn(before_block + tl.cumsum(weight, 0) - weight, total)
                kept = (start + tl.arange(0, SCAN_BLOCK) < num_above) & (mass_before <= top_p)
                num_kept += tl.sum(kept.to(tl.int32), 0)
                before_block += tl.sum(weight, 0)
            # The tied candidates add nothing to the cumulative sum: each has all the mass above before it.
            num_kept += tl.where(tl.math.div_rn(mass_above, total) <= top_p, tied_candidates, 0)
            last_kept = tl.load(candidates_row + tl.maximum(num_kept - 1, 0)).to(tl.float32) * scale
            threshold = tl.maximum(threshold, last_kept)
    tl.store(threshold_ptr + row, threshold)


def top_k_top_p_threshold(candidates: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's top-k / top-p threshold, float32 [n, 1], from its best ``candidates`` [n, c]
    (``torch.topk``'s values of ``logits`` [n, vocab], descending), ``top_k`` [n] (0: off, and the
    row's threshold is -inf), ``top_p`` [n] (1: off) and ``inverse_temperature`` [n] (None: the
    logits come scaled): ``sampler.top_k_top_p_of_candidates``, in one launch."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, num_candidates = candidates.shape
    threshold = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        _top_k_top_p_kernel[(num_rows,)](threshold, candidates.contiguous(), num_candidates, logits, logits.stride(0),
                                         logits.shape[1], top_k, top_p, inverse_temperature, BLOCK=_BLOCK,
                                         SCAN_BLOCK=_SCAN_BLOCK, enable_fp_fusion=False)
    return threshold.unsqueeze(-1)
