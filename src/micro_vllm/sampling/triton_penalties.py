"""The repetition, frequency and presence penalties on CUDA in one Triton pass over the logits.

``logits_processors.apply_penalties`` defines them in PyTorch, on the tokens each row has seen, found
by ``nonzero`` (which waits for the device). Here one program per (row, block of tokens) reads the
row's logits in their own dtype and writes the penalized ones in float32 to a new tensor: the copy the
processors need anyway. A row without penalties (0, 0, 1) is only copied; the others read their
output-token counts and prompt mask once, with the definition's operations in its order: a correctly
rounded division, and no fused multiply-add (the launch turns fp fusion off), so the results equal
PyTorch's bit for bit (but for the sign of a zero logit that a negative penalty leaves unchanged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from micro_vllm.sampling.logits_processors import Penalties

_BLOCK = 1024  # tokens per program: 8 per thread of 4 warps


# A row's settings are one value each, loaded alone: their pointers' alignment (the runner passes the
# rows of one tensor, aligned or not with the batch's size) gains nothing and must not make variants.
@triton.jit(do_not_specialize_on_alignment=["repetition_ptr", "frequency_ptr", "presence_ptr"])
def _penalties_kernel(logits_ptr, logits_stride, out_ptr, out_stride, counts_ptr, counts_stride, prompt_mask_ptr,
                      prompt_mask_stride, repetition_ptr, frequency_ptr, presence_ptr, vocab_size,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)  # of the batch, of its logits and of the token counts alike
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_row).to(tl.float32)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    if (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0):
        count = tl.load(counts_ptr + row * counts_stride + cols, mask=in_row, other=0)
        in_prompt = tl.load(prompt_mask_ptr + row * prompt_mask_stride + cols, mask=in_row, other=0) != 0
        in_output = count > 0
        repeated = tl.where(x > 0, tl.div_rn(x, repetition), x * repetition)
        x = tl.where(in_output | in_prompt, repeated, x)
        x = x - frequency * count.to(tl.float32)
        x = x - presence * in_output.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, x, mask=in_row)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """The ``logits`` [n, vocab] (of any float dtype) penalized, as a new float32 tensor."""
    (num_rows, vocab_size), out = logits.shape, torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    assert logits.stride(-1) == 1
    counts, prompt_mask = penalties.output_token_counts, penalties.prompt_token_mask.view(torch.uint8)
    if num_rows:
        _penalties_kernel[(num_rows, triton.cdiv(vocab_size, _BLOCK))](
            logits, logits.stride(0), out, out.stride(0), counts, counts.stride(0), prompt_mask,
            prompt_mask.stride(0), penalties.repetition, penalties.frequency, penalties.presence, vocab_size,
            BLOCK=_BLOCK, enable_fp_fusion=False,
        )
    return out
