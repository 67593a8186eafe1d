"""Sampling in one pass over the logits on CUDA (Triton): the Gumbel-max trick.

``argmax(logits / T + G)`` with ``G = -log(-log(U))`` draws from ``softmax(logits / T)``; a greedy
row (``T == 0``) takes the plain argmax, ties to the lowest index as ``torch.argmax`` does. The
PyTorch sampler makes about five passes over the logits (scale, softmax, noise, divide, argmax);
this reads them once. ``U`` comes from Triton's Philox generator keyed by a per-row seed and the
vocabulary index, so a row's draw depends only on its seed: the runner derives it from the request's
seed and output position (or from the engine's stream for unseeded rows), which keeps seeded
requests independent of the batch.

Each row is cut into chunks of ``_CHUNK`` tokens, one program each, so a batch of a few rows still
fills the GPU; a chunk's best (score, index) goes to a small buffer whose argmax over chunks (first
wins ties, and chunks are in vocabulary order) picks the token. Top-k / top-p need a sort: the
Sampler masks the scaled logits in PyTorch and passes them here with temperature 1. The scaling
divides (``div_rn``, as PyTorch does), so both routes give a row the same scores and the same draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from micro_vllm.triton_interpreter import interpreted, patch_triton_interpreter

_CHUNK = 8192  # tokens per program: 19 chunks for Qwen3's 151,936-token vocabulary
_BLOCK = 2048  # tokens per loop iteration of a program


@triton.jit
def _fold_block(best, best_index, logits_row, start, u, vocab_size, temperature, greedy, SIZE: tl.constexpr):
    """Fold the ``SIZE`` tokens from ``start`` (noise ``u``) into the per-lane running best: no
    reduction across lanes here, so no barrier per block."""
    cols = start + tl.arange(0, SIZE)
    valid = cols < vocab_size
    x = tl.load(logits_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    if greedy:
        score = x
    else:
        score = tl.div_rn(x, temperature) - tl.log(-tl.log(u))
    better = valid & (score > best)  # strict: a lane keeps its earliest token on a tie
    return tl.where(better, score, best), tl.where(better, cols, best_index)


@triton.jit
def _gumbel_argmax_kernel(best_ptr, best_index_ptr, logits_ptr, logits_stride, temperature_ptr, seed_ptr,
                          vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row)
    greedy = temperature == 0
    temperature = tl.where(greedy, 1.0, temperature)
    logits_row = logits_ptr + row * logits_stride
    QUARTER: tl.constexpr = BLOCK // 4
    first = chunk * CHUNK
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_index = tl.zeros([QUARTER], dtype=tl.int32) + first
    for start in range(first, tl.minimum(first + CHUNK, vocab_size), BLOCK):
        # One Philox call yields four numbers: counter start / 4 + j feeds token start + j of
        # each quarter of the block (a quarter of the generator's work of one call per token).
        # Quarters go in token order, so each lane sees its tokens in increasing order.
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + tl.arange(0, QUARTER))
        best, best_index = _fold_block(best, best_index, logits_row, start, u0, vocab_size, temperature, greedy,
                                       QUARTER)
        best, best_index = _fold_block(best, best_index, logits_row, start + QUARTER, u1, vocab_size, temperature,
                                       greedy, QUARTER)
        best, best_index = _fold_block(best, best_index, logits_row, start + 2 * QUARTER, u2, vocab_size,
                                       temperature, greedy, QUARTER)
        best, best_index = _fold_block(best, best_index, logits_row, start + 3 * QUARTER, u3, vocab_size,
                                       temperature, greedy, QUARTER)
    chunk_best = tl.max(best, 0)
    # The lowest token among the lanes that reach the maximum, as torch.argmax breaks ties.
    chunk_index = tl.min(tl.where(best == chunk_best, best_index, vocab_size), 0)
    tl.store(best_ptr + row * num_chunks + chunk, chunk_best)
    tl.store(best_index_ptr + row * num_chunks + chunk, chunk_index)


if interpreted(_gumbel_argmax_kernel):  # TRITON_INTERPRET=1: tests on CPU
    patch_triton_interpreter()


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [n, vocab]: greedy where ``temperature`` is 0, else a draw
    from ``softmax(logits / temperature)`` keyed by the row's int64 ``seeds``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    chunk = min(_CHUNK, triton.next_power_of_2(vocab_size))
    block = max(min(_BLOCK, chunk), 4)
    num_chunks = triton.cdiv(vocab_size, chunk)
    best = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    if num_rows:
        _gumbel_argmax_kernel[(num_rows, num_chunks)](
            best, best_index, logits, logits.stride(0), temperature.to(torch.float32), seeds, vocab_size,
            num_chunks, CHUNK=chunk, BLOCK=block,
        )
    return best_index.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()
