"""The start-up runs, apart from the step path: the profiling run that measures peak activation
memory, the warm-up that compiles kernels, and the one that leaves the allocators ready for serving,
all as dummy steps that read the null block and write nowhere; and the run of what a step launches
outside its CUDA graph, which loads those kernels. They go through the runner's public phases
(``dummy_inputs``, ``run_model``, ``compute_logits``) and sample with a Sampler of their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from micro_vllm.sampling.logits_processors import LogitsProcessorsMetadata, Penalties, TokenBiases
from micro_vllm.sampling.sampler import Sampler, SamplingMetadata
from micro_vllm.worker.input_batch import TokenCounts

if TYPE_CHECKING:
    from micro_vllm.worker.model_runner import ModelRunner


@torch.inference_mode()
def profile_run(runner: ModelRunner) -> None:
    """Run the largest step the scheduler can plan, with a one-block KV cache, to measure peak
    activation memory."""
    settings = runner.settings
    runner.allocate_kv_cache(1)
    dummy_step(runner, profile_query_lens(settings.max_num_seqs, settings.max_num_batched_tokens,
                                          settings.max_model_len))
    runner.allocate_kv_cache(0)


@torch.inference_mode()
def warm_up(runner: ModelRunner) -> None:
    """Compile the kernels eager steps use before the first request, not in the middle of serving:
    the largest step the scheduler can plan (as the profile run: one prompt as long as a request can
    be, the whole token budget), one lone prompt chunk as long as the budget allows, and one of short
    prompt chunks. The lone chunk takes the attention's prefill tiles even when the largest step
    has none (a budget no larger than ``max_num_seqs`` gives every request one token); the short
    chunks take its decode tiles. Steps that replay a CUDA graph are compiled when it is captured
    (each capture runs its step once first). The largest step also leaves the allocator holding
    blocks of a full step's activation sizes, so the first long prefill steps do not wait for the
    allocator; but only where no CUDA graph is captured after it, since each capture empties that
    cache (``torch.cuda.graph``). Last, the kernels steps launch outside their graphs are loaded."""
    settings = runner.settings
    dummy_step(runner, profile_query_lens(settings.max_num_seqs, settings.max_num_batched_tokens,
                                          settings.max_model_len))
    dummy_step(runner, np.array([min(settings.max_num_batched_tokens, settings.max_model_len)], np.int32))
    dummy_step(runner, np.full(min(settings.max_num_seqs, settings.max_num_batched_tokens // 2, 8), 2, np.int32))
    load_eager_kernels(runner)


def load_eager_kernels(runner: ModelRunner) -> None:
    """Run once each kernel a step launches outside its CUDA graph: the first launch of a kernel in a
    process loads it, and the load waits for the GPU, so a step meeting a kernel not yet loaded would
    wait for the step in flight and lose async scheduling's overlap (the graphs loaded theirs when
    they were captured). What runs outside:

    * the lm_head, at every row count a step can sample (1 to ``max_num_seqs``): cuBLAS picks its
      matmul kernel by the row count;
    * each sampling route: all greedy, top-p alone (over whole rows), top-k alone and top-k with
      top-p over each number of best candidates ``max_top_k`` can ask for (``topk``'s kernels differ
      with it), from the logits as they are and from the scaled fp32 copy that min-p (and top-k
      beside the penalties) makes, the logits processors (which also compiles the Triton route's
      penalties pass), each on one row and on two, as a library may pick its kernel by the row count
      (cuBLAS does);
    * the penalties' token counts: a row rebuilt, the sampled tokens counted, a row moved;
    * the merge of the tokens the last step sampled into a step's input, under async scheduling (an
      int64 ``index_select`` and ``index_copy_``, ``ModelRunner._input_ids``).
    """
    settings = runner.settings
    hidden = runner.run_model(runner.dummy_inputs(np.ones(settings.max_num_seqs, np.int32)))
    for num_rows in range(1, len(hidden) + 1):
        logits = runner.compute_logits(hidden[:num_rows])
    vocab_size = logits.shape[-1]
    candidate_counts = [1 << i for i in range((vocab_size - 1).bit_length())] + [vocab_size]
    sampler = own_sampler(runner, max_num_reqs=2)
    for num_rows in (1, 2):
        rows_logits = logits[:num_rows]
        dummy_sample(sampler, rows_logits, greedy=True)
        dummy_sample(sampler, rows_logits, top_p=0.9)
        # The penalties alone (their pass reads the model's logits), and after the other processors
        # (on the fp32 copy those make).
        dummy_sample(sampler, rows_logits, processors="penalties")
        dummy_sample(sampler, rows_logits, processors="all")
        for count in candidate_counts:
            for min_p in (None, 0.1):  # the candidates of the logits as they are, and of a scaled fp32 copy
                dummy_sample(sampler, rows_logits, top_k=count, max_top_k=count, min_p=min_p)
                sampled = dummy_sample(sampler, rows_logits, top_k=count, top_p=0.9, max_top_k=count, min_p=min_p)
    input_ids = torch.zeros(len(sampled), dtype=torch.int64, device=settings.device)
    rows = torch.arange(len(sampled), device=settings.device)
    input_ids.index_copy_(0, rows, sampled.index_select(0, rows))
    token_counts = TokenCounts(2, vocab_size, settings.device)
    token_counts.reset_row(0, np.arange(3), num_prompt_tokens=2)
    token_counts.count(rows, sampled[rows])
    token_counts.move_rows(np.array([1]), np.array([0]))


@torch.inference_mode()
def warm_up_allocators(runner: ModelRunner) -> None:
    """Leave both CUDA allocators holding what a step allocates outside its CUDA graph (the logits,
    the sampler's buffers, the pinned host copy of the sampled tokens), run after the graphs are
    captured, since each capture empties the device allocator's cache. A device (``cudaMalloc``) or
    pinned host (``cudaHostAlloc``) allocation that the caches cannot serve waits for the GPU, so a
    step meeting a new batch size would otherwise wait for the step running before it to finish,
    and lose async scheduling's overlap. The largest sampling batch, sampled once, leaves device
    blocks that serve every smaller one. The pinned cache gets three blocks of each sampled-token
    copy size: under async scheduling a new step's copy is made while the step before it is in
    flight, and the copy freed just before it is reusable only once the GPU has passed the point
    where it was freed, that is after the step in flight."""
    max_num_seqs = runner.settings.max_num_seqs
    dummy_step(runner, np.ones(max_num_seqs, np.int32))
    for num_reqs in range(1, max_num_seqs + 1):
        copies = [torch.empty(num_reqs, dtype=torch.int64, pin_memory=True) for _ in range(3)]
        del copies  # back to the cache, which keeps them


def dummy_step(runner: ModelRunner, query_lens: np.ndarray) -> None:
    """A forward pass and sampling over dummy requests with these query lengths. Every position
    reads block 0 and writes nowhere: the values are garbage, the memory use and the kernels run
    are real."""
    inputs = runner.dummy_inputs(query_lens)
    logits = runner.compute_logits(runner.run_model(inputs)[inputs.logits_indices])
    # Sampling with a top-k of the whole vocabulary (``topk`` of whole rows, as large as a sort: the
    # sampler's largest buffer), alone and beside min-p (a scaled copy, which the Triton route's
    # kernels read in fp32), with top-p alone (the PyTorch route's sort, the Triton route's search),
    # also over that scaled copy, and without a filter, so the variants of the sampler's kernels
    # (model-dtype and fp32 logits, the top-p search, top-p within the top-k candidates) compile here.
    sampler = own_sampler(runner, max_num_reqs=len(query_lens))
    vocab_size = logits.shape[-1]
    dummy_sample(sampler, logits, top_k=vocab_size, top_p=0.9, max_top_k=vocab_size)
    dummy_sample(sampler, logits, top_k=vocab_size, top_p=0.9, max_top_k=vocab_size, min_p=0.1)
    dummy_sample(sampler, logits, top_p=0.9)
    dummy_sample(sampler, logits, top_p=0.9, min_p=0.1)
    dummy_sample(sampler, logits)


def own_sampler(runner: ModelRunner, max_num_reqs: int) -> Sampler:
    """A Sampler on the runner's route, of its own: the engine's seed streams and torch's global one
    stay untouched."""
    settings = runner.settings
    return Sampler("sampler" in settings.custom_ops, device=settings.device, max_num_reqs=max_num_reqs)


def dummy_sample(sampler: Sampler, logits: torch.Tensor, *, greedy: bool = False, top_k: int | None = None,
                 top_p: float | None = None, max_top_k: int | None = None, min_p: float | None = None,
                 processors: Literal["penalties", "all"] | None = None) -> torch.Tensor:
    """Sample every row of ``logits`` with one setting, as the runner's metadata would send it: all
    greedy, or temperature 1 with this top-k / top-p / min-p (None: off) or with logits processors
    ("penalties" over no tokens, or "all": allowed_token_ids, a bias, a ban and the penalties), drawn
    through the Triton sampler's seeds when it is in use. Returns the sampled ids."""
    num_rows, device = len(logits), logits.device

    def full(value, dtype=torch.float32) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    if greedy:
        metadata = SamplingMetadata(full(0.0), None, None, all_greedy=True, all_random=False)
    else:
        inputs = None
        if processors is not None:
            counts = torch.zeros_like(logits, dtype=torch.int32)
            penalties = Penalties(full(0.5), full(0.5), full(1.5), counts, counts.bool())
            inputs = LogitsProcessorsMetadata(penalties=penalties)
            if processors == "all":
                rows = torch.arange(num_rows, device=device)
                token_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)
                biases = TokenBiases(rows, token_ids, full(1.0))
                inputs = LogitsProcessorsMetadata(allowed_rows=rows, allowed_token_ids=(rows, token_ids),
                                                  logit_bias=biases, bans=biases, penalties=penalties)
        metadata = SamplingMetadata(full(1.0), None if top_k is None else full(top_k, torch.int32),
                                    None if top_p is None else full(top_p), all_greedy=False, all_random=True,
                                    max_top_k=max_top_k, top_p_without_top_k=top_p is not None and top_k is None,
                                    logits_processors=inputs, min_p=None if min_p is None else full(min_p))
    return sampler(logits, sampler.add_row_seeds(metadata, {})).sampled_token_ids


def profile_query_lens(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> np.ndarray:
    """The query lengths of the largest step the scheduler can plan: as many requests as it runs,
    as many tokens as the budget allows, the first one as long as a request can be."""
    num_reqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_reqs * max_model_len)
    query_lens = np.ones(num_reqs, np.int32)
    query_lens[0] = min(max_model_len, num_tokens - (num_reqs - 1))
    if num_reqs > 1:  # the rest of the tokens, spread evenly over the other requests
        rest = num_tokens - int(query_lens[0])
        query_lens[1:] = rest // (num_reqs - 1)
        query_lens[1 : 1 + rest % (num_reqs - 1)] += 1
    return query_lens
