"""The repetition, frequency and presence penalties on CUDA, in Triton.

``logits_processors.apply_penalties`` defines them in PyTorch, on the tokens each row has seen, found
by ``nonzero`` (which waits for the device). Here ``penalize`` applies them to a block of a row's
logits as a kernel reads them: the Triton sampler's draw calls it when the penalties are the batch's
only processor (nothing else then reads the penalized logits), and ``apply_penalties`` runs it in a
pass of its own that writes them in float32 to a new tensor, for the filters and processors that read
them. A row reads its seen-token mask (one byte a token) and the output counts of the tokens it has
seen only, a few thousand of a vocabulary; a row without penalties (0, 0, 1) reads neither. The
definition's operations come in its order: a correctly rounded division, and no fused multiply-add
(the launches turn fp fusion off), so the results equal PyTorch's bit for bit (but for the sign of a
zero logit that a negative penalty leaves unchanged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from micro_vllm.sampling.logits_processors import Penalties

_BLOCK = 1024  # tokens per program: 8 per thread of 4 warps


@triton.jit
def row_penalties(row, counts_ptr, counts_stride, seen_ptr, seen_stride, repetition_ptr, frequency_ptr, presence_ptr):
    """What ``penalize`` needs of ``row``: its output counts, its seen-token mask and its settings."""
    return (counts_ptr + row * counts_stride, seen_ptr + row * seen_stride, tl.load(repetition_ptr + row),
            tl.load(frequency_ptr + row), tl.load(presence_ptr + row))


@triton.jit
def has_penalties(penalties):
    _, _, repetition, frequency, presence = penalties
    return (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)


@triton.jit
def penalize(x, cols, in_row, penalties):
    """The fp32 logits ``x`` of a row's tokens ``cols`` (``in_row``: those in the vocabulary),
    penalized with the row's ``row_penalties``."""
    counts_row, seen_row, repetition, frequency, presence = penalties
    seen = tl.load(seen_row + cols, mask=in_row, other=0) != 0
    count = tl.load(counts_row + cols, mask=seen, other=0)
    repeated = tl.where(x > 0, tl.div_rn(x, repetition), x * repetition)
    x = tl.where(seen, repeated, x)
    x = x - frequency * count.to(tl.float32)
    return x - presence * (count > 0).to(tl.float32)


# A row's settings are one value each, loaded alone: their pointers' alignment (the runner passes the
# rows of one tensor, aligned or not with the batch's size) gains nothing and must not make variants.
@triton.jit(do_not_specialize_on_alignment=["repetition_ptr", "frequency_ptr", "presence_ptr"])
def _penalties_kernel(logits_ptr, logits_stride, out_ptr, out_stride, counts_ptr, counts_stride, seen_ptr,
                      seen_stride, repetition_ptr, frequency_ptr, presence_ptr, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # of the batch, of its logits and of the token counts alike
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_row).to(tl.float32)
    penalties = row_penalties(row, counts_ptr, counts_stride, seen_ptr, seen_stride, repetition_ptr, frequency_ptr,
                              presence_ptr)
    if has_penalties(penalties):
        x = penalize(x, cols, in_row, penalties)
    tl.store(out_ptr + row * out_stride + cols, x, mask=in_row)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """The ``logits`` [n, vocab] (of any float dtype) penalized, as a new float32 tensor."""
    (num_rows, vocab_size), out = logits.shape, torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    assert logits.stride(-1) == 1
    counts, seen = penalties.output_token_counts, seen_bytes(penalties)
    if num_rows:
        _penalties_kernel[(num_rows, triton.cdiv(vocab_size, _BLOCK))](
            logits, logits.stride(0), out, out.stride(0), counts, counts.stride(0), seen, seen.stride(0),
            penalties.repetition, penalties.frequency, penalties.presence, vocab_size, BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )
    return out


def seen_bytes(penalties: Penalties) -> torch.Tensor:
    """The seen-token mask as bytes, which Triton loads (it takes no bool pointer)."""
    return penalties.seen_token_mask.view(torch.uint8)
