"""The repetition, frequency and presence penalties on CUDA in one Triton pass over the logits.

``logits_processors.apply_penalties`` defines them in PyTorch: a dozen operations over every
penalized row's whole vocabulary (gathers of the rows, of their counts and prompt masks, then
each term, then a scatter back). Here one program per (penalized row, block of tokens) reads the
row's logits, output-token counts and prompt mask once and writes the penalized logits in place,
with the same operations in the same order: a correctly rounded division, and no fused
multiply-add (the launch turns fp fusion off), so the results equal PyTorch's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from micro_vllm.sampling.logits_processors import Penalties

_BLOCK = 1024  # tokens per program: 8 per thread of 4 warps


@triton.jit
def _penalties_kernel(logits_ptr, logits_stride, rows_ptr, counts_ptr, counts_stride, prompt_mask_ptr,
                      prompt_mask_stride, repetition_ptr, frequency_ptr, presence_ptr, vocab_size,
                      BLOCK: tl.constexpr):
    index = tl.program_id(0)
    row = tl.load(rows_ptr + index)  # of the batch, of its logits and of the token counts alike
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < vocab_size
    logits_row = logits_ptr + row * logits_stride
    x = tl.load(logits_row + cols, mask=in_row)
    count = tl.load(counts_ptr + row * counts_stride + cols, mask=in_row, other=0)
    in_prompt = tl.load(prompt_mask_ptr + row * prompt_mask_stride + cols, mask=in_row, other=0) != 0
    repetition = tl.load(repetition_ptr + index)
    in_output = count > 0
    repeated = tl.where(x > 0, tl.div_rn(x, repetition), x * repetition)
    x = tl.where(in_output | in_prompt, repeated, x)
    x = x - tl.load(frequency_ptr + index) * count.to(tl.float32)
    x = x - tl.load(presence_ptr + index) * in_output.to(tl.float32)
    tl.store(logits_row + cols, x, mask=in_row)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> None:
    """Penalize, in place, the rows ``penalties.rows`` of the float32 ``logits`` [n, vocab]."""
    num_rows, vocab_size = len(penalties.rows), logits.shape[1]
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    counts, prompt_mask = penalties.output_token_counts, penalties.prompt_token_mask.view(torch.uint8)
    if num_rows:
        _penalties_kernel[(num_rows, triton.cdiv(vocab_size, _BLOCK))](
            logits, logits.stride(0), penalties.rows, counts, counts.stride(0), prompt_mask, prompt_mask.stride(0),
            penalties.repetition, penalties.frequency, penalties.presence, vocab_size, BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )
