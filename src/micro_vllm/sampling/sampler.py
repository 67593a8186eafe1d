"""Turns the logits of a step into one token per row, on the device, in one batch.

First, when a row of the batch asks for logprobs, the raw logprobs of every row are taken (vLLM's
default ``raw_logprobs``: the log-softmax of the model's logits, before anything below changes
them): the sampled token's and as many top tokens as the row that asks for most. Then a
structured-output step's grammar bitmask sets every token a grammar forbids to -inf, and vLLM's
logits processors (``logits_processors.py``: penalties, bad words, ...) apply, so the greedy argmax
and both routes see the processed logits; a grammar's row that the processors' bans leave with no
token falls back to the grammar's mask alone. Greedy rows take the argmax. Random rows are scaled by
temperature, filtered by min-p and top-k / top-p, and drawn with the exponential race (argmax of
p / E with E ~ Exp(1)), which needs no cumulative sums and lets each seeded row draw its noise from
its own generator, so its tokens do not depend on the batch. Top-k / top-p come down to a threshold
per row on the scaled logits: from the row's top candidates when it has a top-k (selected from the
logits as they are and scaled after; the Triton route finds top-p within them in one kernel,
``triton_top_k_top_p.py``), else over its whole row, which the PyTorch route sorts and the Triton
route searches without a sort (``triton_top_p.py``, which scales the logits as it reads them). A
Sampler built with ``use_triton`` draws every batch that samples with the Triton sampler instead
(``triton_sampler.py``: a chunk of the vocabulary by its softmax mass, then Gumbel-max inside it,
with a Philox seed per row, so the same independence holds), which takes the threshold and skips
the tokens below it; only min-p, which reads the scaled logits itself, and top-k over fp32 logits
make a scaled copy here first.

The runner's ``InputBatch`` makes a batch's ``SamplingMetadata`` from its rows' settings when its
rows change; each step adds its seeds (``Sampler.add_row_seeds``), the tokens it bans and its bitmask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer, copy_to_host
from micro_vllm.outputs import LogprobsLists
from micro_vllm.sampling.logits_processors import (LogitsProcessorsMetadata, PenaltiesApplier, apply_logits_processors,
                                                   apply_min_p, apply_penalties)


SEED_POOL_SIZE = 4096  # the engine stream's seeds drawn at once for the Triton sampler

# Each row's top-p threshold over its whole row, [n, 1], from logits [n, vocab] and top_p [n], for
# the logits times the row's inverse temperature [n] when one is given.
WholeRowTopP = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# The threshold of each row with top-k and top-p within it, [n, 1] (-inf for rows without top-k),
# from its best candidates [n, c] (``torch.topk``'s values, descending) of the logits [n, vocab], its
# top_k [n], top_p [n] and inverse temperature [n] (None: the logits come scaled).
TopKTopP = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler needs to know of a batch's rows, on the device (vLLM's name)."""

    temperature: torch.Tensor  # float32 [n]; 0 means greedy
    top_k: torch.Tensor | None  # int32 [n], 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # float32 [n], 1 = off; None when no row uses it
    all_greedy: bool
    all_random: bool  # no greedy row: the argmax of the raw logits is not needed
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its seeded generator
    # int64 [n], one Philox seed per row: set when the batch draws with the Triton sampler, which then
    # replaces the generators.
    seeds: torch.Tensor | None = None
    # The most logprobs a row asks for (-1 resolved to the vocabulary); None: no row asks.
    max_num_logprobs: int | None = None
    logits_processors: LogitsProcessorsMetadata | None = None  # None when no row uses one
    min_p: torch.Tensor | None = None  # float32 [n], 0 = off; None when no row uses it
    # How many of each row's best logits top-k (and top-p within it) need to see (``max_top_k``);
    # None: no row uses top-k.
    max_top_k: int | None = None
    # Whether a row uses top-p without top-k: its nucleus is searched over its whole row.
    top_p_without_top_k: bool = False
    # int32 [n, words] on the device, xgrammar's layout (token t is bit t % 32 of word t // 32): the
    # tokens each row's grammar allows, all ones for a row without one; None: no row has one.
    grammar_bitmask: torch.Tensor | None = None


class LogprobsTensors(NamedTuple):
    """One row per position (vLLM's name): the position's own token first, then the top k, best first."""

    logprob_token_ids: torch.Tensor  # int64 [n, 1 + k]
    logprobs: torch.Tensor  # float32 [n, 1 + k]
    ranks: torch.Tensor  # int64 [n]: of the own token in the whole vocabulary, 1 the best

    def to_host(self) -> LogprobsTensors:
        """Pinned host copies, queued without blocking (see ``copy_to_host``)."""
        return LogprobsTensors(*(copy_to_host(t) for t in self))

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())

    @staticmethod
    def cat(chunks: list[LogprobsTensors]) -> LogprobsTensors:
        """The rows of several chunks of positions, in order (the chunks share their k)."""
        return LogprobsTensors(*(torch.cat(parts) for parts in zip(*chunks)))


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [n]
    logprobs_tensors: LogprobsTensors | None  # when a row asked: its sampled token's and the top max_num_logprobs


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The raw logprobs (vLLM's default ``logprobs_mode``): the log-softmax of the model's logits."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The top ``num_logprobs`` of each row of ``logprobs`` [n, vocab], behind the row's own token
    ``token_ids`` [n], its logprob and its rank: 1 + the number of other tokens at least as likely
    (vLLM's count, so a token tied with others takes the last of their ranks)."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.long().unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(torch.cat((token_ids, top_ids), dim=1), torch.cat((token_logprobs, top_logprobs), dim=1),
                           ranks)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in ``bitmask`` (int32 words, xgrammar's layout,
    covering the whole logits width) is 0."""
    words = bitmask.to(logits.device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
    logits.masked_fill_(bits.flatten(1)[:, : logits.shape[1]] == 0, float("-inf"))


def keep_a_token_the_grammar_allows(processed: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``processed`` with each row that the logits processors left no token (every logit -inf) taken
    from ``masked``, the logits under the grammar's mask alone: bans beside a grammar can forbid every
    token it allows (``min_tokens`` holding back EOS where the grammar allows only EOS, say), and the
    output must still match its grammar, so the grammar wins over the bans there."""
    no_token_left = torch.isneginf(processed).all(dim=-1, keepdim=True)
    return torch.where(no_token_left, masked.float(), processed)


def max_top_k(top_k: np.ndarray) -> int | None:
    """How many top candidates hold every top-k set of the rows with these settings (a host array):
    the largest ``top_k`` rounded up to a power of two; None when no row uses top-k. Extra candidates
    change no row's kept set (``apply_top_k_top_p``), and the rounding keeps the counts few: ``topk``
    launches other kernels for other counts, and start-up loads those of each
    (``dummy_run.load_eager_kernels``)."""
    if not top_k.any():
        return None
    return 1 << (int(top_k.max()) - 1).bit_length()


def top_k_top_p_of_candidates(candidates: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor,
                              top_p: torch.Tensor, inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The threshold, float32 [n, 1], of each row with a top-k (-inf for the others) and top-p
    within it, from its best ``candidates`` [n, c] of ``logits`` [n, vocab], descending, as
    ``top_k_top_p_threshold`` selects them: the larger of its top-k threshold and its top-p one,
    with the tie at the k-th counted over the vocabulary."""
    kth = _kth_candidate(candidates, top_k)
    num_tied = (logits == kth).sum(dim=-1, keepdim=True)
    threshold = _top_k_threshold(kth, top_k, inverse_temperature)
    if inverse_temperature is not None:
        candidates = candidates.float() * inverse_temperature.unsqueeze(-1)
    top_p_of_rows = torch.where(top_k > 0, top_p, 1.0)
    return torch.maximum(threshold, _top_p_threshold(candidates, threshold, num_tied, top_p_of_rows))


def _kth_candidate(candidates: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th best candidate [n, 1], as the candidates are (k clamped to their number)."""
    k = top_k.long().clamp(1, candidates.shape[-1]).unsqueeze(-1)
    return candidates.gather(-1, k - 1)


def _top_k_threshold(kth: torch.Tensor, top_k: torch.Tensor, inverse_temperature: torch.Tensor | None) -> torch.Tensor:
    """Each row's top-k threshold, float32 [n, 1]: its k-th candidate ``kth`` times its inverse
    temperature; -inf for a row without top-k."""
    kth = kth.float()
    if inverse_temperature is not None:
        kth = kth * inverse_temperature.unsqueeze(-1)
    return torch.where(top_k.unsqueeze(-1) > 0, kth, float("-inf"))


def top_k_top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                          max_top_k: int | None, whole_row_top_p: WholeRowTopP | None = None,
                          inverse_temperature: torch.Tensor | None = None,
                          top_k_top_p: TopKTopP = top_k_top_p_of_candidates) -> torch.Tensor:
    """Each row's threshold, float32 [n, 1], on ``logits`` times ``inverse_temperature`` [n] (or on
    ``logits`` as they are): its top-k and then its top-p nucleus are the tokens at least as large
    (-inf: every token).

    Top-k keeps the tokens at least as large as the row's k-th largest logit (all of a tie). Top-p
    then keeps a token when the probability of the tokens strictly above it (within the top-k set)
    is at most ``top_p``: the smallest set of best tokens whose mass reaches ``top_p``, with all of
    a tie. Both come down to one threshold per row. A row with top-k finds it among its best
    candidates in descending order, the top ``max_top_k`` (``torch.topk`` selects them without
    sorting the vocabulary), selected from the logits as they are and then scaled: multiplying by a
    positive ``1 / T`` keeps their order, and rounds the k-th to the k-th of the scaled logits. It also
    keeps apart any two distinct bf16 or fp16 logits (their 8 or 11 significant bits are far coarser
    than the fp32 product's 24), so the tie at the k-th is counted on the logits as they are; fp32
    logits must come scaled, as the Sampler gives them. With top-p, the threshold from the candidates
    is ``top_k_top_p``'s: ``top_k_top_p_of_candidates`` (the default) or the Triton kernel
    (``triton_top_k_top_p``). A row with top-p and no top-k (there must be one when
    ``whole_row_top_p`` is given, and only then) gets its threshold over its whole row from
    ``whole_row_top_p``: ``sorted_top_p_threshold`` or the Triton search (``triton_top_p``).
    ``top_k`` 0 and ``top_p`` 1 turn a row's filter off."""
    threshold = torch.full_like(logits[:, :1], float("-inf"), dtype=torch.float32)
    if top_k is not None:
        candidates = logits.topk(min(max_top_k, logits.shape[-1]), dim=-1).values
        if top_p is None:
            threshold = _top_k_threshold(_kth_candidate(candidates, top_k), top_k, inverse_temperature)
        else:
            threshold = top_k_top_p(candidates, logits, top_k, top_p, inverse_temperature)
    if whole_row_top_p is not None:
        top_p_alone = top_p if top_k is None else torch.where(top_k > 0, 1.0, top_p)
        threshold = torch.maximum(threshold, whole_row_top_p(logits, top_p_alone, inverse_temperature))
    return threshold


def sorted_top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor,
                           inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The top-p threshold of each whole row, float32 [n, 1], by its definition: from the row (times
    ``inverse_temperature``) sorted (-inf where ``top_p`` is 1)."""
    if inverse_temperature is not None:
        logits = logits.float() * inverse_temperature.unsqueeze(-1)
    return _top_p_threshold(logits.sort(dim=-1, descending=True).values, None, None, top_p)


def _top_p_threshold(candidates: torch.Tensor, top_k_threshold: torch.Tensor | None, num_tied: torch.Tensor | None,
                     top_p: torch.Tensor) -> torch.Tensor:
    """The smallest logit of each row's top-p nucleus within its top-k set (-inf for rows with
    ``top_p`` 1). ``candidates`` [n, c] are the row's best logits in descending order, which hold
    its nucleus: the whole row without a top-k, else all of its top-k set but maybe some of the
    ``num_tied`` tokens tied with the k-th, which are counted over the vocabulary.

    A row's decision must not depend on how many candidates its batch took (a seeded request
    draws the same tokens in any batch): every sum is a prefix sum over the row's own tokens above
    its k-th logit, whose terms and order are the same whatever follows them, and the tie at the
    k-th counts as a number of equal terms."""
    best = candidates[:, :1]
    weights = (candidates - best).exp()
    in_top_k = True
    if top_k_threshold is None:
        cumulative = weights.cumsum(dim=-1)
        total = cumulative[:, -1:]
    else:
        in_top_k = candidates >= top_k_threshold
        weights = weights.masked_fill(candidates <= top_k_threshold, 0.0)  # the tie at the k-th comes below
        cumulative = weights.cumsum(dim=-1)
        total = cumulative[:, -1:] + num_tied * (top_k_threshold - best).exp()
    # A tie is kept or dropped as one: the threshold is the value of the last candidate kept.
    mass_before = (cumulative - weights) / total
    num_kept = (in_top_k & (mass_before <= top_p.unsqueeze(-1))).sum(dim=-1, keepdim=True)
    threshold = candidates.gather(-1, (num_kept - 1).clamp(min=0))
    return threshold.masked_fill(top_p.unsqueeze(-1) >= 1, float("-inf"))


class Sampler:
    """Draws one token per row. Rows without a seed of their own draw from the engine's ``seed``:
    through a torch generator, or with ``use_triton`` through a stream of Philox seeds, staged for at
    most ``max_num_reqs`` rows. Which argmax and which route it takes is chosen once, here."""

    def __init__(self, use_triton: bool, seed: int = 0, device: torch.device = torch.device("cpu"),
                 max_num_reqs: int = 0) -> None:
        self.use_triton = use_triton
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.argmax = cpu_argmax if device.type == "cpu" else _device_argmax
        self.whole_row_top_p: WholeRowTopP = sorted_top_p_threshold
        self.top_k_top_p: TopKTopP = top_k_top_p_of_candidates
        self.penalize: PenaltiesApplier = apply_penalties
        if use_triton:
            from micro_vllm.sampling import triton_penalties, triton_sampler, triton_top_k_top_p, triton_top_p

            self.triton_sample = triton_sampler.sample
            self.whole_row_top_p = triton_top_p.top_p_threshold
            self.top_k_top_p = triton_top_k_top_p.top_k_top_p_threshold
            self.penalize = triton_penalties.apply_penalties
            self.seed_stream = np.random.default_rng(seed)
            self.seed_pool = np.empty(0, np.int64)  # the stream's next seeds, drawn ahead
            self.seed_pool_start = 0
            self.seeds = CpuGpuBuffer((max_num_reqs,), torch.int64, device)

    def add_row_seeds(self, metadata: SamplingMetadata, row_seeds: dict[int, int]) -> SamplingMetadata:
        """The batch's metadata with its seeded rows (row -> seed) given to the route that will draw
        them: for the Triton sampler a Philox seed for every row (the others from the engine's
        stream), copied to the device without blocking; else a torch generator per seeded row. The
        runner calls it while it stages a step's inputs, so the copy is one of the step's copies it
        waits for."""
        if self.use_triton and not metadata.all_greedy:
            n = len(metadata.temperature)
            seeds = self.seeds.np[:n]
            seeds[:] = self._next_seeds(n)
            if row_seeds:
                seeds[list(row_seeds)] = list(row_seeds.values())
            return replace(metadata, seeds=self.seeds.copy_to_device(n))
        if not row_seeds:
            return metadata
        return replace(metadata, generators={row: torch.Generator(device=self.device).manual_seed(seed)
                                             for row, seed in row_seeds.items()})

    def _next_seeds(self, n: int) -> np.ndarray:
        """The engine stream's next ``n`` seeds. A draw costs mostly its call, so they are drawn
        ahead in bulk; the values are those of drawing ``n`` at a time, since each seed takes the
        bit generator's next outputs and nothing else."""
        if len(self.seed_pool) - self.seed_pool_start < n:
            rest = self.seed_pool[self.seed_pool_start:]
            drawn = self.seed_stream.integers(0, 2**63 - 1, max(n, SEED_POOL_SIZE))
            self.seed_pool, self.seed_pool_start = np.concatenate([rest, drawn]), 0
        start = self.seed_pool_start
        self.seed_pool_start += n
        return self.seed_pool[start : start + n]

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """One token per row of ``logits`` (changed in place by a grammar bitmask), with the raw
        logprobs the batch asks for."""
        num_logprobs = metadata.max_num_logprobs
        raw_logprobs = None if num_logprobs is None else compute_logprobs(logits)
        if metadata.grammar_bitmask is not None:
            apply_grammar_bitmask(logits, metadata.grammar_bitmask)
        sampled = self.sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, num_logprobs, sampled))

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.logits_processors is not None:
            processed = apply_logits_processors(logits, metadata.logits_processors, self.penalize)
            if metadata.grammar_bitmask is not None:
                processed = keep_a_token_the_grammar_allows(processed, logits)
            logits = processed
        if metadata.all_greedy:
            return self.argmax(logits)
        temperature = metadata.temperature
        # What the filters read and the draw takes: the logits as they are, which the top-k / top-p
        # filters and the Triton draw scale as they read them, or a scaled copy made here once, where
        # min-p reads the scaled logits itself, the PyTorch route draws (then drawn at temperature 1,
        # which keeps them), or a row has top-k over fp32 logits (an fp32 model's, or processed ones),
        # which scaling can round into ties the top-k filter must count.
        scaled = (metadata.min_p is not None or metadata.seeds is None
                  or (logits.dtype == torch.float32 and metadata.top_k is not None))
        scores, threshold = logits, None
        if scaled:
            scores = logits.float() * _inverse_temperature(temperature).unsqueeze(-1)
            if metadata.min_p is not None:
                scores = apply_min_p(scores, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            whole_row_top_p = self.whole_row_top_p if metadata.top_p_without_top_k else None
            threshold = top_k_top_p_threshold(scores, metadata.top_k, metadata.top_p, metadata.max_top_k,
                                              whole_row_top_p, None if scaled else _inverse_temperature(temperature),
                                              self.top_k_top_p)
        if metadata.seeds is not None:
            # A greedy row's argmax survives any filter.
            draw_temperature = (temperature > 0).float() if scaled else temperature
            return self.triton_sample(scores, draw_temperature, metadata.seeds, threshold)
        if threshold is not None:
            scores = scores.masked_fill(scores < threshold, float("-inf"))
        probs = scores.softmax(dim=-1)
        noise = _exponential_noise(probs, self.generator)
        for row, generator in metadata.generators.items():
            noise[row] = _exponential_noise(probs[row], generator)
        sampled = self.argmax(probs.div_(noise))
        if metadata.all_random:
            return sampled
        return torch.where(temperature > 0, sampled, self.argmax(logits))


def _exponential_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Exp(1) noise shaped as ``like``: ``-log(U)`` for ``U`` uniform in [0, 1), never 0 (a 0 would
    make its token win whatever its probability; ``U = 0`` gives inf, which only rules one token out
    at a chance of 2^-24). On CPU ``exponential_`` draws value by value, several times slower than a
    uniform draw and a vectorized log."""
    return torch.rand(like.shape, generator=generator, device=like.device, dtype=like.dtype).log_().neg_()


def _inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """Each row's ``1 / T`` (1 for a greedy row), correctly rounded as the Triton sampler takes it, so
    that both routes give a row the same scores ``logits * (1 / T)``."""
    return torch.where(temperature > 0, 1 / temperature, 1.0)


def _device_argmax(scores: torch.Tensor) -> torch.Tensor:
    return scores.argmax(dim=-1)


ARGMAX_CHUNK = 128  # vocabulary entries per chunk of the CPU argmax's first pass


def cpu_argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's ``argmax`` over the last axis of CPU ``scores``, as ``torch.argmax`` gives it (the
    lowest index among ties; a NaN counts as the largest).

    On CPU ``argmax``'s kernel tracks an index beside every value and is several times slower than the
    vectorized ``amax``; so the rows are cut into chunks, ``amax`` finds each chunk's largest value,
    and ``argmax`` runs only over those maxima and then inside the first chunk holding the row's
    largest: the same index, the lowest among ties, reading the row once."""
    vocab = scores.shape[-1]
    if vocab % ARGMAX_CHUNK:
        return scores.argmax(dim=-1)
    chunks = scores.reshape(-1, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [rows]
    inside = chunks.gather(1, best_chunk.view(-1, 1, 1).expand(-1, 1, ARGMAX_CHUNK)).squeeze(1).argmax(dim=-1)
    return best_chunk * ARGMAX_CHUNK + inside
