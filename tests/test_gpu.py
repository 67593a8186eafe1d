"""The engine on a CUDA device, end to end (marked gpu; skipped without CUDA).

* fp32: greedy outputs identical to transformers on the same GPU (TF32 off), for every family on
  triton, block size 32 and the sdpa backend on the families whose paging they meet differently,
  chunked prefill forced, and under preemption.
* bf16: identical to transformers up to the first near tie of transformers' own logits, and never
  different where its top two logits are far apart (the tolerance is stated in gpu_helpers.py).
* CUDA graphs on vs off, chunked prefill on vs off, prefix caching on vs off: the same greedy
  outputs; where two bf16 runs differ, only at a near tie of transformers' logits (the same rule).
* Head sizes 12 to 256 (no power of two among 12, 20, 80, 96), GQA 1 to 8, on triton: fp32
  identical to transformers, bf16 up to near ties (the grid of helpers/model_shapes.py).
* Seeded sampling does not depend on the batch; step inputs survive a GPU that runs behind the
  host; the Qwen3-0.6B-shaped benchmark model runs with default settings and sizes its KV cache
  from gpu_memory_utilization.

The tiny models are the random ones of tiny_models.py, made bigger (hidden 256, 3 layers) so that
head sizes 64 and 128, GQA ratios 1, 2 and 4, sliding windows and two KV cache groups all occur.
Their embeddings are untied: with tied unit-scale embeddings the residual stream keeps the input
token's embedding and the model only repeats its last token, which no attention bug would change.

Most of this file's time is engine start-up: Triton compiles the kernel variants of every new
(dtype, head size, GQA ratio, block size, window) and each engine captures a CUDA graph per decode
batch size up to max_num_seqs. So tests share engines through the ``shared_engine`` fixture (one
engine per family and settings for the whole module), the engines run at most 16 requests (five
graphs) unless a test needs more, and a case is parametrized only where it reaches code the others
do not. A new test that can use an engine built with the same settings asks ``shared_engine`` for
it, and puts back whatever it changes on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import sys
from pathlib import Path

import pytest
import torch

from helpers.core_helpers import check_all_free, token_ids
from helpers.gpu_helpers import (
    Reference,
    check_greedy_agreement,
    hf_gaps_along,
    hf_greedy,
    load_hf,
)
from helpers.model_shapes import SHAPES, shape_id, shape_overrides
from helpers.structured_output import MAX_TOKENS, REQUESTS, check_all, generate
from micro_vllm import LLM, SamplingParams
from micro_vllm.attention.backends import triton_attn
from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path
from micro_vllm.worker.cuda_graphs import MIN_DECODE_GRAPH_BATCH, CudaGraphShape
from helpers.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bench_model, throughput
MAX_MODEL_LEN = 256  # = max_position_embeddings of the tiny models
MAX_NUM_SEQS = 16  # graphs for 1, 2, 4, 8 and 16 decodes: sizes of both kinds (powers of two, multiples of 16)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, tie_word_embeddings=False)
MODELS = {
    # head size 64, GQA 1
    "llama": dict(num_attention_heads=4, num_key_value_heads=4),
    # head size 128, GQA 2, a window shorter than prompt + output and no multiple of a block size
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, sliding_window=24),
    # head size 64, GQA 2, q/k/v bias
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    # head size 128, GQA 2, YaRN (cos/sin scaled by its attention factor) past its original 64 positions
    "qwen2_rope_yarn": dict(num_attention_heads=2, num_key_value_heads=1),
    # head size 128, GQA 4, q/k norm
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128),
    # head size 64, GQA 2; layer 0 full attention, layers 1-2 a window of 20: two KV cache groups
    "qwen3_sliding": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=20, max_window_layers=1
    ),
}


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


# Lengths that cross block boundaries (of 16 and 32) and windows, from 1 token to 150.
PROMPTS = _prompts([1, 7, 23, 37, 61, 100, 150, 12], seed=0)
NUM_TOKENS = 40


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def engine_settings(**overrides) -> dict:
    """Our defaults for the tiny models: bf16, triton, CUDA graphs, a token budget that chunks
    prompts, and an explicit cache big enough that nothing is preempted (sizing from
    gpu_memory_utilization would take 90% of the card for each engine)."""
    settings = dict(
        device=DEVICE,
        dtype="bfloat16",
        attention_backend="triton",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=64,
        max_num_seqs=MAX_NUM_SEQS,
        block_size=16,
    )
    settings.update(overrides)
    if "num_blocks" not in settings:  # every running request at full length, in two groups
        blocks_per_seq = -(-settings["max_model_len"] // settings["block_size"])
        settings["num_blocks"] = settings["max_num_seqs"] * blocks_per_seq * 2 + 1
    return settings


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def engine(path: Path, **overrides):
    llm = LLM(model=str(path), **engine_settings(**overrides))
    try:
        yield llm
    finally:
        llm.shutdown()
        _release()


def runner_of(llm: LLM):
    return llm.engine.executor.worker.model_runner


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def true_fp32():
    """fp32 must mean fp32: no TF32 in cuBLAS or cuDNN, for our engine and transformers alike."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_models")
    return {family: make_tiny_model(family, root, **_SIZES, **MODELS[family]) for family in MODELS}


class References:
    """transformers on the GPU, loaded once per (family, dtype); greedy references cached."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        self.model_dirs = model_dirs
        self.models: dict = {}
        self.greedy_cache: dict = {}

    def model(self, family: str, dtype: torch.dtype):
        if (family, dtype) not in self.models:
            self.models[family, dtype] = load_hf(self.model_dirs[family], dtype, DEVICE)
        return self.models[family, dtype]

    def greedy(self, family: str, dtype: torch.dtype) -> list[Reference]:
        """transformers' greedy continuations of PROMPTS, with its top-two gap at every step."""
        if (family, dtype) not in self.greedy_cache:
            model = self.model(family, dtype)
            self.greedy_cache[family, dtype] = [hf_greedy(model, p, NUM_TOKENS) for p in PROMPTS]
        return self.greedy_cache[family, dtype]

    def assert_same_greedy(self, family: str, dtype: torch.dtype, prompts, ours, theirs, what: str) -> None:
        """Two runs of our engine agree: identical, or first different at a near tie of transformers'
        logits on the common prefix."""
        for i, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
            if a == b:
                continue
            reference = hf_gaps_along(self.model(family, dtype), prompt, a)
            agreement = check_greedy_agreement(a, b, reference, f"{what}, request {i}")
            assert agreement.error is None, agreement.error


@pytest.fixture(scope="module")
def refs(model_dirs):
    references = References(model_dirs)
    yield references
    references.models.clear()
    _release()


@pytest.fixture(scope="module")
def shared_engine(model_dirs):
    """``shared_engine(family, **overrides)``: the module's engine for this family with
    ``engine_settings(**overrides)``, built on first use. A test that changes something on it (a
    patched method, the prefix cache it relies on) puts it back."""
    engines: dict[str, LLM] = {}

    def get(family: str, **overrides) -> LLM:
        settings = engine_settings(**overrides)
        key = f"{family} {sorted(settings.items())}"
        if key not in engines:
            engines[key] = LLM(model=str(model_dirs[family]), **settings)
        return engines[key]

    yield get
    for llm in engines.values():
        llm.shutdown()
    engines.clear()
    _release()


# -- the benchmark model, with default settings ----------------------------------------------------

# The two tests that size their KV cache from gpu_memory_utilization, a share of the whole GPU, run one
# after the other when test processes share the GPU (pytest-xdist's --dist loadgroup).
SIZED_FROM_GPU_MEMORY = pytest.mark.xdist_group("sized-from-gpu-memory")


@SIZED_FROM_GPU_MEMORY
def test_benchmark_model_runs_with_default_settings(tmp_path):
    """The Qwen3-0.6B-shaped random model (2 layers) on defaults: bf16, triton, CUDA graphs, and a
    KV cache sized from gpu_memory_utilization after the profiling run."""
    from bench_model import QWEN3_0_6B, build_random_model

    path = build_random_model(tmp_path / "qwen3-0.6b-2-layers", num_hidden_layers=2)
    _release()
    utilization = 0.3
    # The engine's share is of the whole GPU: what the GPU holds already (engines of earlier tests,
    # other test processes) comes out of it.
    free, total = torch.cuda.mem_get_info()
    budget = utilization * total - (total - free)
    reserved_before = torch.cuda.memory_reserved()
    llm = LLM(model=str(path), gpu_memory_utilization=utilization)
    try:
        runner = runner_of(llm)
        settings = runner.settings
        assert settings.device.type == "cuda"
        assert settings.dtype == torch.bfloat16
        assert settings.attention_backend == "triton"
        assert runner.cuda_graphs.graphs, "CUDA graphs are on by default on CUDA"

        kv_bytes = llm.engine.num_blocks * runner.kv_cache_bytes_per_block()
        assert llm.engine.num_blocks > 0
        # The weights (~0.35 GB) and the profiled activations (~1 GB) come out of the budget; the
        # KV cache takes the rest, so it is most of it, and never more than the share.
        assert 0.5 * budget <= kv_bytes <= utilization * total, (kv_bytes, budget, total)

        rng = random.Random(0)
        lengths, max_tokens = [3, 50, 700, 2500], [1, 7, 33, 64]
        prompts = [[rng.randrange(QWEN3_0_6B["vocab_size"]) for _ in range(n)] for n in lengths]
        # The last request's penalties make the runner allocate their token counts, which the
        # sizing left room for.
        params = [
            SamplingParams(max_tokens=m, temperature=0.0 if i % 2 else 0.7, ignore_eos=True,
                           repetition_penalty=1.1 if i == 3 else 1.0)
            for i, m in enumerate(max_tokens)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert all(0 <= t < QWEN3_0_6B["vocab_size"] for o in outputs for t in o.outputs[0].token_ids)

        torch.cuda.synchronize()
        # Everything the engine allocated (weights, KV cache, CUDA graph pools, step buffers, the
        # penalties' token counts) stays near the budget: graph pools and step buffers come after the
        # sizing, so allow a little over.
        held = torch.cuda.memory_reserved() - reserved_before
        assert held <= budget + 2 * 2**30, (held, budget)
    finally:
        llm.shutdown()
        _release()


# -- start-up compilation -----------------------------------------------------------------------


def test_serving_compiles_no_triton_kernel(model_dirs):
    """Start-up (warm-up steps and graph capture) compiles every Triton kernel variant that serving
    needs: a lone long prompt, chunked prompts beside decodes, short prompts and decode batches of
    any size then compile nothing. Block size 32 in bf16 is no other test's, so no other engine of
    this process has compiled these attention variants already (which would hide a gap in start-up)."""
    from throughput import triton_compilations

    for family in ("qwen3", "mistral"):
        with engine(model_dirs[family], block_size=32) as llm:
            compiled = triton_compilations()
            llm.generate([_prompts([200], seed=6)[0]], greedy(3), use_tqdm=False)
            llm.generate(PROMPTS + GRAPH_PROMPTS[:20], greedy(12), use_tqdm=False)
            llm.generate(_prompts([3, 5, 2], seed=7), greedy(2), use_tqdm=False)
            assert triton_compilations() == compiled, f"{family}: serving compiled Triton kernels"


def test_serving_allocates_no_memory(model_dirs):
    """After start-up, steps of any batch size, greedy or with top-k / top-p, allocate no device and no
    pinned host memory: either allocation waits for the GPU, so a step meeting a new batch size would
    wait for the step before it. The device allocator's cache is emptied by each graph capture and the
    pinned one is emptied here, so only the engine's own start-up can have filled them."""
    from latency import allocations

    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache
    empty_host_cache()
    with engine(model_dirs["qwen3"]) as llm:
        before = allocations()
        prompts = _prompts(list(range(5, 5 + 6 * MAX_NUM_SEQS, 6)), seed=8)
        filters = [dict(top_k=20, top_p=0.9), dict(top_p=0.9), {}]  # each route a sampling batch can take
        params = [SamplingParams(max_tokens=2 + i, temperature=0.8, ignore_eos=True, **filters[i % 3])
                  for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts[:5], greedy(9), use_tqdm=False)
        assert allocations() == before, "serving allocated memory after start-up"


def test_serving_loads_no_kernel_after_start_up(tmp_path):
    """A kernel's first launch in a process loads it, and the load waits for the GPU, so a step meeting
    a kernel not yet loaded waits for the step before it and async scheduling loses its overlap. The
    graphs load their kernels at capture; start-up runs what a step launches outside them. After it,
    serving loads nothing: prompts chunked beside decodes (the merge of the last step's tokens),
    decode batches shrinking by a request a step, each route a sampling batch takes (the logits
    processors' too: the first request with penalties allocates their token counts), and the lm_head
    at every row count (cuBLAS picks its kernel by the rows). The Qwen3-0.6B-shaped model (2 layers)
    gives the lm_head its real hidden size and vocabulary."""
    from torch.profiler import ProfilerActivity, profile

    from bench_model import build_random_model

    path = build_random_model(tmp_path / "qwen3-0.6b-2-layers", num_hidden_layers=2)
    max_num_seqs = 48
    prompts = _prompts([10 + 4 * i for i in range(max_num_seqs)], seed=9)  # prompt + output within MAX_MODEL_LEN
    routes = [dict(top_k=20, top_p=0.9), dict(top_p=0.9), dict(top_k=20), {}, dict(temperature=0), dict(min_p=0.05),
              dict(top_k=20, min_p=0.05), dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2),
              dict(presence_penalty=0.5, logit_bias={7: 2.0}, allowed_token_ids=list(range(1000)), min_tokens=2)]
    mixed = [SamplingParams(**{"temperature": 0.8, **routes[i % len(routes)]}, max_tokens=1 + i, ignore_eos=True)
             for i in range(max_num_seqs)]  # one request finishes each step
    batches = [mixed] + [[SamplingParams(**{"temperature": 0.8, **route}, max_tokens=4, ignore_eos=True)] * size
                         for route in routes for size in (1, 6)]  # each route alone
    with engine(path, max_num_seqs=max_num_seqs, max_num_batched_tokens=256) as llm:
        model = runner_of(llm).model
        hidden = torch.randn(max_num_seqs, model.config.hidden_size, dtype=torch.bfloat16, device=DEVICE)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for params in batches:
                llm.generate(prompts[: len(params)], params, use_tqdm=False)
            with torch.inference_mode():
                for num_rows in range(1, max_num_seqs + 1):
                    model.compute_logits(hidden[:num_rows])
            torch.cuda.synchronize()
    events = list(prof.events())
    ops = [event for event in events if event.name.startswith("aten::")]
    loaded_by = []  # the innermost aten op around each load: what launched the kernel
    for load in (event for event in events if event.name == "Lazy Function Loading"):
        around = [op for op in ops if op.time_range.start <= load.time_range.start <= op.time_range.end]
        loaded_by.append(max(around, key=lambda op: op.time_range.start).name if around else "?")
    assert not loaded_by, f"serving loaded {len(loaded_by)} kernels after start-up, in {loaded_by}"


# -- fp32: identical to transformers -----------------------------------------------------------


def _assert_matches_reference(outputs, references: list[Reference], what: str) -> None:
    for i, (prompt, output, reference) in enumerate(zip(PROMPTS, outputs, references)):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].finish_reason == "length"
        agreement = check_greedy_agreement(output.outputs[0].token_ids, reference.tokens, reference, f"{what}, prompt {i}")
        assert agreement.error is None, agreement.error


# fp32 with a 24-token budget, which chunks every prompt longer than that and mixes chunks with
# decodes, and four running requests at most, so requests queue and rows of the persistent batch move.
FP32 = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=4)

# Every family on the default backend. Block size 32 where blocks meet what a family adds to the
# paging: a window of 24, no multiple of either block size (mistral), and two KV cache groups
# (qwen3_sliding). sdpa, the slow twin, on one KV head per query head, a window with GQA, and two groups.
FP32_CASES = sorted(
    [(family, "triton", 16) for family in MODELS]
    + [(family, "triton", 32) for family in ("mistral", "qwen3_sliding")]
    + [(family, "sdpa", 16) for family in ("llama", "mistral", "qwen3_sliding")],
    key=lambda case: list(MODELS).index(case[0]),  # a family's cases together: they share its references
)


@pytest.mark.parametrize("family, backend, block_size", FP32_CASES)
def test_fp32_greedy_matches_transformers(family, backend, block_size, refs, shared_engine):
    """fp32 on the GPU, TF32 off: our greedy tokens are transformers' (a difference is excused only
    at a top-two gap below 2^-13 of the largest logit, i.e. an exact tie for practical purposes)."""
    references = refs.greedy(family, torch.float32)
    llm = shared_engine(family, **FP32, attention_backend=backend, block_size=block_size)
    outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False)
    check_all_free(llm.engine.scheduler)
    _assert_matches_reference(outputs, references, f"{family}/{backend}/block {block_size}")


def test_fp32_greedy_matches_transformers_under_preemption(model_dirs, refs):
    """A cache too small for the four running requests: the most recent is preempted and recomputed,
    and the tokens do not change."""
    family = "llama"
    references = refs.greedy(family, torch.float32)
    with engine(model_dirs[family], **FP32, num_blocks=16) as llm:
        scheduler = llm.engine.scheduler
        preempt, preemptions = scheduler._preempt, []

        def counting_preempt(request):
            preemptions.append(request.request_id)
            return preempt(request)

        scheduler._preempt = counting_preempt
        outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False)
    assert preemptions, "the cache was meant to be too small: nothing was preempted"
    _assert_matches_reference(outputs, references, "llama/triton/preemption")


# -- bf16: identical to transformers up to near ties ----------------------------------------------


@pytest.mark.parametrize("family", list(MODELS))
def test_bf16_greedy_matches_transformers_up_to_near_ties(family, refs, shared_engine):
    """bf16 with our defaults (triton, CUDA graphs, chunked prefill) against transformers in bf16,
    step by step: the same tokens until the first position where transformers' two best logits are
    within the bf16 tolerance of gpu_helpers.py (BF16_TIE_ULPS), and no difference anywhere else."""
    references = refs.greedy(family, torch.bfloat16)
    outputs = shared_engine(family).generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False)
    compared = 0
    for i, (prompt, output, reference) in enumerate(zip(PROMPTS, outputs, references)):
        assert output.prompt_token_ids == prompt and output.outputs[0].finish_reason == "length"
        what = f"{family}, prompt {i}"
        agreement = check_greedy_agreement(output.outputs[0].token_ids, reference.tokens, reference, what)
        assert agreement.error is None, agreement.error
        compared += agreement.compared
    # Near ties are rare (gaps below the tolerance at ~15-20% of positions, and only some of those
    # flip): most tokens must have been held to identity, or the comparison proved nothing.
    assert compared >= len(PROMPTS) * NUM_TOKENS // 4, f"only {compared} tokens compared"


# -- head sizes -----------------------------------------------------------------------------------


# Every shape in fp32, where any difference is a bug. In bf16 (the families' head sizes 64 and 128
# are bf16 in the tests above) the smallest padded head, one padded to 128 and the widest.
GRID_CASES = [(shape, "float32") for shape in SHAPES] + [
    (shape, "bfloat16") for shape in SHAPES if shape[1] in (12, 80, 256)
]


@pytest.mark.parametrize(
    "shape, dtype", GRID_CASES, ids=[f"{shape_id(shape)}-{dtype}" for shape, dtype in GRID_CASES]
)
def test_head_size_grid_matches_transformers(shape, dtype, tmp_path):
    """The triton backend (with the fused ops and CUDA graphs) on heads padded inside the kernels
    and on the widest it serves: greedy tokens of transformers, up to the near-tie rule of dtype."""
    path = make_tiny_model(shape[0], tmp_path, **shape_overrides(shape))
    reference_model = load_hf(path, DTYPES[dtype], DEVICE)
    references = [hf_greedy(reference_model, prompt, NUM_TOKENS) for prompt in PROMPTS]
    del reference_model
    with engine(path, **dict(FP32, dtype=dtype)) as llm:
        assert runner_of(llm).settings.attention_backend == "triton"
        outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False)
    _assert_matches_reference(outputs, references, f"{shape_id(shape)}/{dtype}")


# -- CUDA graphs on vs off -------------------------------------------------------------------------


class GraphReplays:
    """Records, for each replay of a captured graph, (requests in the step, the graph's shape)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.replays: list[tuple[int, CudaGraphShape]] = []
        self._num_reqs = 0
        self._saved_graphs = dict(runner.cuda_graphs.graphs)
        execute = runner.execute_model

        def noting_execute(plan):
            self._num_reqs = len(plan.num_scheduled_tokens)
            return execute(plan)

        runner.execute_model = noting_execute
        for shape, (graph, output) in self._saved_graphs.items():
            runner.cuda_graphs.graphs[shape] = (self._Counting(graph, shape, self), output)

    class _Counting:
        def __init__(self, graph, shape: CudaGraphShape, owner: GraphReplays) -> None:
            self.graph, self.shape, self.owner = graph, shape, owner

        def replay(self) -> None:
            self.owner.replays.append((self.owner._num_reqs, self.shape))
            self.graph.replay()

    def restore(self) -> None:
        del self.runner.execute_model  # the instance attribute; the method shows through again
        self.runner.cuda_graphs.graphs.clear()
        self.runner.cuda_graphs.graphs.update(self._saved_graphs)


# 33 requests that finish at different times, 16 of them running at once, so decode batches shrink
# from 16 to 1 through the captured sizes (8 and 16) and are padded to the next one on the way;
# their prompts, chunked by the budget of 64 tokens, make steps with prefill chunks beside decodes.
GRAPH_PROMPTS = _prompts([random.Random(i).randint(2, 60) for i in range(33)], seed=1)
GRAPH_MAX_TOKENS = [4 + (7 * i) % 45 for i in range(33)]


@pytest.mark.parametrize(
    "family,dtype,kv_cache_dtype",
    [("qwen3", "bfloat16", "auto"), ("mistral", "bfloat16", "auto"), ("qwen3_sliding", "bfloat16", "auto"),
     ("llama", "float32", "auto"), ("llama", "bfloat16", "fp8")],
)
def test_cuda_graphs_match_eager(family, dtype, kv_cache_dtype, model_dirs, refs, shared_engine):
    """Steps replayed from CUDA graphs (padded to the next captured shape), decode batches and steps
    with prefill chunks alike, give the tokens of the same engine with enforce_eager=True, whose
    steps all run eagerly; with an fp8 KV cache too."""
    params = [greedy(m) for m in GRAPH_MAX_TOKENS]
    graphs = shared_engine(family, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    graphs.reset_prefix_cache()  # prompts computed in full, as in the eager engine
    runner = runner_of(graphs)
    assert runner.cuda_graphs.graphs, "no CUDA graphs were captured with enforce_eager=False on CUDA"
    decode_sizes = [shape.num_reqs for shape in runner.cuda_graphs.graphs if shape.uniform_decode]
    assert min(decode_sizes) == MIN_DECODE_GRAPH_BATCH and max(decode_sizes) == MAX_NUM_SEQS
    replays = GraphReplays(runner)
    try:
        with_graphs = token_ids(graphs.generate(GRAPH_PROMPTS, params, use_tqdm=False))
    finally:
        replays.restore()
    assert runner.model.attention_layers()[0].kv_cache.dtype == (
        torch.float8_e4m3fn if kv_cache_dtype == "fp8" else getattr(torch, dtype))
    with engine(model_dirs[family], dtype=dtype, kv_cache_dtype=kv_cache_dtype, enforce_eager=True) as eager:
        assert not runner_of(eager).cuda_graphs.graphs
        without = token_ids(eager.generate(GRAPH_PROMPTS, params, use_tqdm=False))

    assert [len(t) for t in with_graphs] == GRAPH_MAX_TOKENS
    sizes = {shape.num_reqs for _, shape in replays.replays if shape.uniform_decode}
    padded = {(n, shape) for n, shape in replays.replays if shape.uniform_decode and n < shape.num_reqs}
    mixed = {shape for _, shape in replays.replays if not shape.uniform_decode}
    assert sizes == set(decode_sizes), f"decode steps replayed only graph sizes {sorted(sizes)}"
    assert padded, "no decode step was padded to a bigger graph"
    assert len(mixed) >= 2, f"steps with prefill chunks replayed only the graphs of {sorted(mixed)}"
    refs.assert_same_greedy(family, DTYPES[dtype], GRAPH_PROMPTS, with_graphs, without, f"{family} graphs vs eager")


def test_mixed_graphs_of_more_tokens_than_a_request_match_eager(model_dirs, refs):
    """A step padded to a mixed graph of more tokens than ``max_model_len``, whose padding outgrows the
    dummy prompt (the rest belongs to no request), gives the eager engine's tokens."""
    prompts = _prompts([30, 35, 40, 33], seed=7)  # 138 prompt tokens: steps pad to the 256-token graph
    settings = dict(max_model_len=64, max_num_batched_tokens=256)
    with engine(model_dirs["llama"], **settings) as graphs:
        replays = GraphReplays(runner_of(graphs))
        try:
            with_graphs = token_ids(graphs.generate(prompts, greedy(8), use_tqdm=False))
        finally:
            replays.restore()
    with engine(model_dirs["llama"], enforce_eager=True, **settings) as eager:
        without = token_ids(eager.generate(prompts, greedy(8), use_tqdm=False))
    assert max(shape.num_tokens for _, shape in replays.replays if not shape.uniform_decode) == 256
    refs.assert_same_greedy("llama", torch.bfloat16, prompts, with_graphs, without, "long mixed graphs vs eager")


def test_mixed_graphs_on_both_sides_of_the_long_query_tiles_match_eager(model_dirs, refs, monkeypatch):
    """With the long-prefill tiles from 48-token queries on, each mixed graph whose query bound
    reaches 48 is captured twice: a step of short prompts replays the one bounded below 48 (the
    general tiles), a step with a longer prompt the other (the long tiles).
    Both give the eager engine's tokens."""
    monkeypatch.setattr(triton_attn, "_LONG_QUERY", 48)
    monkeypatch.setattr(triton_attn.TritonBackend, "long_query_len", 48)
    batches = [_prompts([20, 25, 30], seed=8), _prompts([60, 10], seed=9)]  # 75 and 70 tokens: the 128-token graphs
    settings = dict(max_model_len=128, max_num_batched_tokens=128)
    with engine(model_dirs["llama"], **settings) as graphs:
        replays = GraphReplays(runner_of(graphs))
        try:
            with_graphs = [token_ids(graphs.generate(prompts, greedy(8), use_tqdm=False)) for prompts in batches]
        finally:
            replays.restore()
    with engine(model_dirs["llama"], enforce_eager=True, **settings) as eager:
        without = [token_ids(eager.generate(prompts, greedy(8), use_tqdm=False)) for prompts in batches]
    bounds = {shape.max_query_len for _, shape in replays.replays if shape.num_tokens == 128}
    assert bounds == {47, 128}, f"the 128-token steps replayed graphs bounded at {sorted(bounds)}"
    for prompts, got, expected in zip(batches, with_graphs, without):
        refs.assert_same_greedy("llama", torch.bfloat16, prompts, got, expected, "mixed graphs by query bound vs eager")


# -- chunked prefill and prefix caching on vs off ------------------------------------------------

# Ten requests, eight of them sharing an 80-token prefix (five blocks of 16), then two unrelated.
_PREFIX = _prompts([80], seed=2)[0]
SHARED_PROMPTS = [_PREFIX + s for s in _prompts([1, 5, 9, 17, 30, 2, 40, 11], seed=3)] + _prompts([50, 90], seed=4)
SHARED_TOKENS = 32


# The window of every layer (mistral), and a full-attention group beside a window group (qwen3_sliding),
# whose cache hits are the shorter of the two groups' hits.
@pytest.mark.parametrize("family", ["mistral", "qwen3_sliding"])
def test_chunked_prefill_and_prefix_caching_keep_greedy_outputs(family, model_dirs, refs, shared_engine):
    """bf16, triton, CUDA graphs. The shared engine chunks prompts (64-token budget) and caches
    prefixes; against it: whole prompts in one step (chunked prefill off) and no prefix cache."""
    params = greedy(SHARED_TOKENS)
    base = shared_engine(family)
    first = base.generate(SHARED_PROMPTS, params, use_tqdm=False)
    second = base.generate(SHARED_PROMPTS, params, use_tqdm=False)  # every prompt's blocks are cached now
    assert all(o.num_cached_tokens >= 16 for o in second), [o.num_cached_tokens for o in second]

    with engine(model_dirs[family], enable_chunked_prefill=False, max_num_batched_tokens=512) as whole:
        unchunked = whole.generate(SHARED_PROMPTS, params, use_tqdm=False)
    with engine(model_dirs[family], enable_prefix_caching=False) as uncached_engine:
        uncached = uncached_engine.generate(SHARED_PROMPTS, params, use_tqdm=False)
        uncached_again = uncached_engine.generate(SHARED_PROMPTS, params, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in uncached + uncached_again)

    dtype, prompts = torch.bfloat16, SHARED_PROMPTS
    baseline = token_ids(first)
    assert [len(t) for t in baseline] == [SHARED_TOKENS] * len(prompts)
    refs.assert_same_greedy(family, dtype, prompts, token_ids(second), baseline, f"{family} cache hits vs first run")
    refs.assert_same_greedy(family, dtype, prompts, token_ids(unchunked), baseline, f"{family} chunked prefill off")
    refs.assert_same_greedy(family, dtype, prompts, token_ids(uncached), baseline, f"{family} prefix caching off")
    assert token_ids(uncached_again) == token_ids(uncached)  # same engine, same shapes: bit for bit


# -- seeded sampling ----------------------------------------------------------------------------


@pytest.mark.parametrize("filters", [dict(top_p=0.9, top_k=20), dict(top_p=0.9), {}],
                         ids=["top-k-top-p", "top-p", "temperature-only"])
def test_seeded_sampling_does_not_depend_on_the_batch(shared_engine, filters):
    """Same seed, same tokens, alone or in any batch, on the GPU sampler with CUDA graphs. With
    temperature only, the request alone takes the sampler kernels' unfiltered route and in the crowd
    (which has top-k / top-p rows) the filtered route: the draws must agree. With top-p alone, its
    threshold comes from the top-p search whether or not the batch has top-k rows. In fp32: a seeded
    request cannot be more reproducible than its logits, and in bf16 those may differ in the last
    bit with the batch's shape (GEMM kernels chosen by the number of rows, graph padding); fp32
    makes that negligible, so what is tested is the sampler's per-request noise."""
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True, **filters)
    others = [
        greedy(24),
        SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True),  # unseeded: the engine's generator
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.5, top_k=3, ignore_eos=True),
    ]
    mine = PROMPTS[3]
    llm = shared_engine("mistral", **FP32)  # four running: the crowd's last request waits for a row
    alone = llm.generate([mine], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [PROMPTS[0], PROMPTS[5], mine, PROMPTS[6], PROMPTS[1]]
    crowded = llm.generate(crowd, others[:2] + [seeded] + others[2:], use_tqdm=False)
    twins = llm.generate([mine, PROMPTS[4], mine], [seeded, others[2], seeded], use_tqdm=False)
    reseeded = llm.generate([mine], dataclasses.replace(seeded, seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 24
    assert crowded[2].outputs[0].token_ids == alone
    assert twins[0].outputs[0].token_ids == twins[2].outputs[0].token_ids == alone
    assert reseeded != alone


# -- async scheduling ---------------------------------------------------------------------------


def test_async_scheduling_matches_the_synchronous_loop(shared_engine):
    """fp32, triton, CUDA graphs. With async scheduling (the default) a decode takes the token the
    step before sampled straight from the device; the tokens must be those of the synchronous loop,
    also for requests that stop early (a stop token) while their next step is already planned."""
    prompts = GRAPH_PROMPTS
    sync = shared_engine("llama", dtype="float32", async_scheduling=False)
    planned_ahead = shared_engine("llama", dtype="float32")
    for llm in (sync, planned_ahead):
        llm.reset_prefix_cache()  # no hits from earlier tests' runs of these prompts
    free = token_ids(sync.generate(prompts, [greedy(m) for m in GRAPH_MAX_TOKENS], use_tqdm=False))
    # Every third request stops at its third token.
    params = [
        dataclasses.replace(greedy(m), ignore_eos=False, stop_token_ids=[t[2]]) if i % 3 == 0 and m > 3 else greedy(m)
        for i, (m, t) in enumerate(zip(GRAPH_MAX_TOKENS, free))
    ]
    expected = sync.generate(prompts, params, use_tqdm=False)
    assert planned_ahead.engine.config.scheduler_config.async_scheduling
    outputs = planned_ahead.generate(prompts, params, use_tqdm=False)
    assert not planned_ahead.engine.in_flight
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs] == [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in expected
    ]
    stopped = [o for o in expected if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 5 and all(len(o.outputs[0].token_ids) <= 3 for o in stopped)


# -- pinned step buffers ------------------------------------------------------------------------


def test_step_inputs_survive_a_gpu_that_runs_behind(refs, shared_engine, monkeypatch):
    """The runner fills pinned host buffers and copies them to the device without blocking, and
    reuses the buffers the next step. That is safe only if a step cannot overwrite them before the
    GPU has run the previous step's copies. Steps that sample nothing (chunks of a long prompt) end
    without reading anything back, so here a GPU sleep queued before every step keeps the GPU behind
    the host: the tokens must still be transformers' (fp32), as in an undisturbed run."""
    family = "llama"
    prompt = _prompts([200], seed=5)[0]  # 9 chunks of at most 24 tokens; only the last one samples
    reference = hf_greedy(refs.model(family, torch.float32), prompt, 8)
    llm = shared_engine(family, **FP32)
    llm.reset_prefix_cache()  # every chunk computed, in both runs
    undisturbed = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    executor = llm.engine.executor
    execute = executor.execute_model

    def behind(plan):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time queued ahead of this step's copies
        return execute(plan)

    monkeypatch.setattr(executor, "execute_model", behind)
    assert llm.reset_prefix_cache()
    delayed = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    for what, tokens in (("undisturbed", undisturbed), ("GPU behind the host", delayed)):
        agreement = check_greedy_agreement(tokens, reference.tokens, reference, what)
        assert agreement.error is None, agreement.error
    assert delayed == undisturbed


# -- structured output ----------------------------------------------------------------------------


@pytest.mark.real_model
@SIZED_FROM_GPU_MEMORY
def test_structured_output_on_cuda():
    """The default model on CUDA with its defaults (bf16, CUDA graphs, async scheduling, the Triton
    sampler): under their grammars, greedy and seeded outputs of every schema, regex, choice and
    grammar match their constraints and stop where the grammar ends, unconstrained requests beside
    them included."""
    try:
        model_dir = default_model_path()
    except DefaultModelUnavailable as e:
        pytest.skip(f"default model unavailable: {e}")
    unconstrained = ("Write a haiku about the sea.", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    with LLM(model=str(model_dir), device=DEVICE, max_model_len=MAX_MODEL_LEN) as llm:
        for sampling in (dict(temperature=0), dict(temperature=0.7, seed=1)):
            requests = [(prompt, SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=so, **sampling))
                        for prompt, so in REQUESTS]
            outputs = generate(llm, [unconstrained, *requests])
            check_all({prompt: outputs[prompt].text for prompt, _ in REQUESTS})
            assert all(outputs[prompt].finish_reason == "stop" for prompt, _ in REQUESTS), sampling
            assert len(outputs[unconstrained[0]].token_ids) == 16


# -- vLLM's sampling API on the device -------------------------------------------------------------


def _sampling_api_requests() -> list[tuple[list[int], SamplingParams]]:
    """Every new parameter, some alone and some together, greedy and seeded, in one batch."""
    from micro_vllm import StructuredOutputsParams

    every = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={7: 2.0},
                 bad_words=["ab"], min_tokens=6, logprobs=5, prompt_logprobs=3)
    params = [
        SamplingParams(max_tokens=24, temperature=0, **every),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, top_k=40, top_p=0.9, min_p=0.05, **every),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, allowed_token_ids=list(range(32, 127))),
        SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=11, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=32, temperature=0.8, seed=5, structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})),
        SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")),
        greedy(24),
    ]
    return [(prompt, p) for prompt, p in zip(GRAPH_PROMPTS, params)]


def test_sampling_api_matches_the_synchronous_loop_and_the_cpu(model_dirs, shared_engine):
    """fp32, triton, CUDA graphs, the Triton sampler: penalties (device token counts), bad words (the
    newest token compared on the device), min_tokens, logit_bias, allowed ids, min-p, logprobs and
    prompt logprobs, n > 1 and structured output give with async scheduling exactly the tokens and
    logprobs of the synchronous loop, and the CPU engine's tokens and logprobs (fp32, so equal up to
    rounding)."""
    import json
    import re

    requests = _sampling_api_requests()
    prompts, params = [p for p, _ in requests], [s for _, s in requests]

    def run(llm: LLM):
        llm.reset_prefix_cache()  # every prompt computed in full, as the CPU engine's
        outputs = llm.generate(prompts, params, use_tqdm=False)
        check_all_free(llm.engine.scheduler)
        return outputs

    def tokens(outputs):
        return [[c.token_ids for c in o.outputs] for o in outputs]

    planned_ahead = run(shared_engine("llama", dtype="float32"))
    sync = run(shared_engine("llama", dtype="float32", async_scheduling=False))
    with engine(model_dirs["llama"], dtype="float32", device="cpu", attention_backend="sdpa", custom_ops=["none"],
                enforce_eager=True) as cpu_engine:
        cpu = run(cpu_engine)
    assert tokens(planned_ahead) == tokens(sync)
    # Seeded rows draw from Philox on the GPU and from torch generators on the CPU: only the greedy
    # rows are the CPU's.
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [tokens(planned_ahead)[i] for i in greedy_rows] == [tokens(cpu)[i] for i in greedy_rows]
    for i in greedy_rows:
        for gpu_completion, cpu_completion in zip(planned_ahead[i].outputs, cpu[i].outputs):
            for gpu_top, cpu_top in zip(gpu_completion.logprobs or [], cpu_completion.logprobs or []):
                assert gpu_top.keys() == cpu_top.keys()
                for token_id, entry in gpu_top.items():
                    assert entry.logprob == pytest.approx(cpu_top[token_id].logprob, abs=1e-3)
    first = planned_ahead[0].outputs[0]
    assert len(first.token_ids) >= 6 and all(len(top) in (5, 6) for top in first.logprobs)
    assert len(planned_ahead[0].prompt_logprobs) == len(prompts[0])
    assert all(32 <= t < 127 for t in planned_ahead[2].outputs[0].token_ids)
    assert [c.index for c in planned_ahead[3].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in planned_ahead[3].outputs}) > 1
    assert isinstance(json.loads(planned_ahead[4].outputs[0].text)["n"], int)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", planned_ahead[5].outputs[0].text)
