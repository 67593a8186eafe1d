"""Sampling on CUDA in two Triton kernels: a pass that only reads the logits, then a small draw.

A random row draws from ``softmax(logits / T)`` in two steps: a chunk of the vocabulary, with
probability its share of the softmax mass, then a token of that chunk by the Gumbel-max trick.
P(chunk) * P(token | chunk) is the softmax exactly (up to fp32 rounding), and random numbers are
needed for one chunk per row only. Gumbel-max over the whole row, which this replaces, spent about
100 instructions per token (a Philox draw, two logarithms, a division) and was bound by them, not by
memory; the reading pass's loop compiles to about 13 per token (sm_90).

``_chunk_stats_kernel`` (rows x chunks) keeps per chunk the maximum of the base-2 score
``x * (1 / T) * log2(e)`` and the sum of ``exp2(score - max)``, rescaled once per block (online
softmax); for a greedy row (``T == 0``) the argmax of ``x``, ties to the lowest index as
``torch.argmax``. ``_pick_token_kernel`` (one program per row): a greedy row takes the argmax of the
first chunk that holds its maximum; a random row draws a chunk by weight ``sum * exp2(max - row max)``
and runs Gumbel-max over its tokens. The noise is Philox keyed by the row's seed (counter 0 for the
chunk, 1 + i for token i), so a row's draw depends only on its seed and logits: the runner derives
the seed from the request's seed and output position, which keeps seeded requests independent of
the batch.

Top-k / top-p are not found here: the Sampler gives each row a threshold on its scaled logits, and
tokens below it are never drawn (nor are ``-inf`` ones, as min-p leaves them in logits the Sampler
scaled itself and passes here with temperature 1). Both sides scale by the correctly rounded ``1 / T``,
so both routes give a row the same scores and the same draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Qwen3's 151,936 tokens make 75 chunks of 2,048: two rows give the H200's 132 SMs 150 programs, and
# the draw's Gumbel pass over one chunk is 16 tokens per thread (4 warps). Chunks of 4,096 (38 per
# row) would need four rows to fill the SMs and double that pass.
_CHUNK = 2048
_BLOCK = 1024  # tokens per loop iteration: 8 per thread, one 16-byte load of bf16


@triton.jit
def _load_logits(logits_row, cols, end):
    """The logits of the tokens ``cols`` before ``end`` in fp32, -inf past it."""
    return tl.load(logits_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)


@triton.jit
def _scaled_score(logits_row, cols, end, inverse_temperature, threshold):
    """Base-2 scores ``x / T * log2(e)`` of the tokens ``cols`` before ``end`` (-inf past it, and
    where ``x / T`` is below the row's ``threshold``); the product ``x * (1 / T)`` is the Sampler's
    own scaling, so a pre-scaled row keeps its scores."""
    scaled = _load_logits(logits_row, cols, end) * inverse_temperature
    return tl.where(scaled >= threshold, scaled * 1.4426950408889634, float("-inf"))


@triton.jit
def _keep_best(best, best_index, score, cols):
    """Fold a block into the per-lane running best, no reduction across lanes: a lane sees its tokens
    in increasing order and keeps the first on a tie (strict >), and a -inf score never wins."""
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_index)


@triton.jit
def _first_best(best, best_index, vocab_size):
    """The lowest token among the lanes that reach the maximum, as torch.argmax breaks ties."""
    return tl.min(tl.where(best == tl.max(best, 0), best_index, vocab_size), 0)


@triton.jit
def _chunk_stats_kernel(chunk_max_ptr, chunk_sum_ptr, chunk_argmax_ptr, logits_ptr, logits_stride, temperature_ptr,
                        threshold_ptr, vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_THRESHOLD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    logits_row = logits_ptr + row * logits_stride
    first = chunk * CHUNK
    end = tl.minimum(first + CHUNK, vocab_size)
    out = row * num_chunks + chunk
    temperature = tl.load(temperature_ptr + row)
    if temperature == 0:
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_index = tl.zeros([BLOCK], dtype=tl.int32) + first
        for start in range(first, end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            best, best_index = _keep_best(best, best_index, _load_logits(logits_row, cols, end), cols)
        tl.store(chunk_max_ptr + out, tl.max(best, 0))
        tl.store(chunk_argmax_ptr + out, _first_best(best, best_index, vocab_size))
    else:
        inverse_temperature = tl.div_rn(1.0, temperature)  # correctly rounded, as PyTorch's 1 / T
        threshold = tl.load(threshold_ptr + row) if HAS_THRESHOLD else float("-inf")
        chunk_max = float("-inf")
        total = tl.zeros([BLOCK], dtype=tl.float32)  # per lane, relative to chunk_max
        for start in range(first, end, BLOCK):
            score = _scaled_score(logits_row, start + tl.arange(0, BLOCK), end, inverse_temperature, threshold)
            new_max = tl.maximum(chunk_max, tl.max(score, 0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf block adds exp2(-inf) = 0
            total = total * tl.exp2(chunk_max - shift) + tl.exp2(score - shift)
            chunk_max = new_max
        tl.store(chunk_max_ptr + out, chunk_max)
        tl.store(chunk_sum_ptr + out, tl.sum(total, 0))


@triton.jit
def _pick_chunk(chunk_max_ptr, chunk_sum_ptr, stats, num_chunks, seed, CHUNKS: tl.constexpr):
    """The chunk a random row draws from: chunk c with probability ``sum_c * exp2(max_c - max)`` over
    the total (0 for an all -inf chunk), the first whose cumulative weight passes ``u * total``.
    Rounding may leave ``u * total`` at or past the last sum: then the last chunk of nonzero weight,
    so a chunk of weight 0 is never picked."""
    chunks = tl.arange(0, CHUNKS)
    in_row = chunks < num_chunks
    chunk_max = tl.load(chunk_max_ptr + stats + chunks, mask=in_row, other=float("-inf"))
    chunk_sum = tl.load(chunk_sum_ptr + stats + chunks, mask=in_row, other=0.0)
    row_max = tl.max(chunk_max, 0)
    weight = chunk_sum * tl.exp2(chunk_max - row_max)
    target = tl.rand(seed, tl.full([], 0, tl.int32)) * tl.sum(weight, 0)
    drawable = weight > 0
    last = tl.max(tl.where(drawable, chunks, 0), 0)
    return tl.min(tl.where(drawable & (tl.cumsum(weight, 0) > target), chunks, last), 0)


@triton.jit
def _pick_token_kernel(token_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_argmax_ptr, logits_ptr, logits_stride,
                       temperature_ptr, threshold_ptr, seed_ptr, vocab_size, num_chunks, CHUNK: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNKS: tl.constexpr, HAS_THRESHOLD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    stats = row * num_chunks
    temperature = tl.load(temperature_ptr + row)
    if temperature == 0:
        # The argmax of the first chunk that holds the row's maximum, as torch.argmax breaks ties.
        chunks = tl.arange(0, CHUNKS)
        in_row = chunks < num_chunks
        chunk_max = tl.load(chunk_max_ptr + stats + chunks, mask=in_row, other=float("-inf"))
        first_best = tl.min(tl.where(in_row & (chunk_max == tl.max(chunk_max, 0)), chunks, CHUNKS), 0)
        token = tl.load(chunk_argmax_ptr + stats + first_best)
    else:
        seed = tl.load(seed_ptr + row)
        chunk = _pick_chunk(chunk_max_ptr, chunk_sum_ptr, stats, num_chunks, seed, CHUNKS)
        inverse_temperature = tl.div_rn(1.0, temperature)
        threshold = tl.load(threshold_ptr + row) if HAS_THRESHOLD else float("-inf")
        logits_row = logits_ptr + row * logits_stride
        first = chunk * CHUNK
        end = tl.minimum(first + CHUNK, vocab_size)
        # Gumbel-max in base 2 over the chunk: argmax(score - log2(-log2(U))) is a draw from
        # softmax(score * ln 2) (the ln 2 between log2 and ln shifts every token alike).
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_index = tl.zeros([BLOCK], dtype=tl.int32) + first
        for start in range(first, end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            noise = -tl.log2(-tl.log2(tl.rand(seed, cols + 1)))
            score = _scaled_score(logits_row, cols, end, inverse_temperature, threshold) + noise
            best, best_index = _keep_best(best, best_index, score, cols)
        token = _first_best(best, best_index, vocab_size)
    tl.store(token_ptr + row, token.to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
           threshold: torch.Tensor | None = None) -> torch.Tensor:
    """One int64 token per row of ``logits`` [n, vocab]: greedy where ``temperature`` is 0, else a
    draw from ``softmax(logits / temperature)`` keyed by the row's int64 ``seeds``, over the tokens
    whose ``logits / temperature`` is at least the row's ``threshold`` [n, 1] when one is given (the
    Sampler's top-k / top-p; a greedy row's argmax is always among them)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    chunk = min(_CHUNK, triton.next_power_of_2(vocab_size))
    block = min(_BLOCK, chunk)
    num_chunks = triton.cdiv(vocab_size, chunk)
    device = logits.device
    # Per (row, chunk): a greedy row fills the maximum and the argmax, a random row the maximum and the sum.
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=device)
    chunk_argmax = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=device)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows:
        temperature = temperature.to(torch.float32)
        _chunk_stats_kernel[(num_rows, num_chunks)](
            chunk_max, chunk_sum, chunk_argmax, logits, logits.stride(0), temperature, threshold, vocab_size,
            num_chunks, CHUNK=chunk, BLOCK=block, HAS_THRESHOLD=threshold is not None,
        )
        _pick_token_kernel[(num_rows,)](
            tokens, chunk_max, chunk_sum, chunk_argmax, logits, logits.stride(0), temperature, threshold, seeds,
            vocab_size, num_chunks, CHUNK=chunk, BLOCK=block, CHUNKS=triton.next_power_of_2(num_chunks),
            HAS_THRESHOLD=threshold is not None,
        )
    return tokens
