"""End to end through LLM: prefix caching, preemption and sliding windows change how requests are
computed, never what they generate (tiny random models, CPU, fp32, the sdpa backend).

Each family runs the same greedy requests twice, once in a setting that exercises the feature and
once without it, and the outputs must be equal token for token; a Mistral model whose window is
smaller than prompt plus output is also checked against transformers in a cache that full
attention could not fit in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from helpers.core_helpers import check_all_free, token_ids
from helpers.gpu_helpers import hf_greedy
from helpers.tiny_models import one_torch_thread  # noqa: F401  (an autouse fixture)
from micro_vllm import LLM, SamplingParams
from helpers.tiny_models import load_hf_reference, make_tiny_model

# qwen3_sliding has a full-attention layer and a sliding-window layer: two KV cache groups.
FAMILIES = ("llama", "mistral", "qwen3", "qwen3_sliding")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SHARED = [(i * 53 + 7) % 250 for i in range(44)]  # 5.5 blocks of 8
FIRST_CALL = [SHARED + [1, 2, 3], SHARED + [9], SHARED[:20], SHARED + [1, 2, 3], SHARED[:37] + [5, 6]]
# The last prompt starts with the tokens of SHARED's second block: equal tokens under another
# parent (and at other positions) must not hit.
SECOND_CALL = [SHARED + [77, 78], SHARED[:30], [5, 6, 7], SHARED[8:16] * 2 + [4]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: make_tiny_model(family, root) for family in FAMILIES}


def make_llm(path, **overrides) -> LLM:
    settings = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
    settings.update(overrides)
    return LLM(model=str(path), device="cpu", dtype="float32", attention_backend="sdpa", **settings)


@dataclass
class StepLog:
    """What the scheduler did, read right after each plan, while the step's blocks are held."""

    preempted: list[str] = field(default_factory=list)
    peak_blocks_in_use: int = 0


def log_steps(llm: LLM) -> StepLog:
    scheduler = llm.engine.scheduler
    kv = scheduler.kv_cache_manager
    schedule = scheduler.schedule
    log = StepLog()

    def logged_schedule():
        plan = schedule()
        log.preempted += plan.preempted_req_ids
        log.peak_blocks_in_use = max(log.peak_blocks_in_use, kv.num_usable_blocks - kv.num_free_blocks)
        return plan

    scheduler.schedule = logged_schedule
    return log


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_caching_does_not_change_outputs(family, model_dirs):
    cached, uncached = make_llm(model_dirs[family]), make_llm(model_dirs[family], enable_prefix_caching=False)
    with_cache = [cached.generate(prompts, GREEDY, use_tqdm=False) for prompts in (FIRST_CALL, SECOND_CALL)]
    without = [uncached.generate(prompts, GREEDY, use_tqdm=False) for prompts in (FIRST_CALL, SECOND_CALL)]
    for hit, plain in zip(with_cache, without):
        assert token_ids(hit) == token_ids(plain)
        assert all(o.num_cached_tokens == 0 for o in plain)
    first, second = with_cache
    # Within one call: requests admitted after the first chunk of SHARED reuse it (some in the very
    # step that computes it); the exact duplicate hits every full block but the one of its last token.
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens > 0 for o in first[1:])
    assert first[3].num_cached_tokens == 40
    # Across calls: the blocks of the first call are still cached.
    assert [o.num_cached_tokens for o in second] == [40, 24, 0, 0]
    check_all_free(cached.engine.scheduler)
    # Until the cache is reset: then the second call's prompts hit only what they share among
    # themselves (prompt 1 reuses prompt 0's first 24 tokens), as in a fresh engine.
    assert cached.reset_prefix_cache()
    after_reset = cached.generate(SECOND_CALL, GREEDY, use_tqdm=False)
    fresh = make_llm(model_dirs[family]).generate(SECOND_CALL, GREEDY, use_tqdm=False)
    assert token_ids(after_reset) == token_ids(fresh) == token_ids(second)
    assert [o.num_cached_tokens for o in after_reset] == [o.num_cached_tokens for o in fresh] == [0, 24, 0, 0]


PREEMPT_PROMPTS = [[(i * 31 + j * 7) % 250 for j in range(20 + 3 * i)] for i in range(4)]


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_does_not_change_outputs(family, model_dirs):
    settings = dict(max_model_len=64, max_num_batched_tokens=16, block_size=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = make_llm(model_dirs[family], enable_prefix_caching=False, **settings)
    # A cache that holds the longest request and nothing more, so the four must take turns.
    longest = max(len(p) for p in PREEMPT_PROMPTS) + params.max_tokens
    num_blocks = 1 + roomy.engine.scheduler.kv_cache_manager.max_blocks_needed(longest, 16)
    tight = make_llm(model_dirs[family], num_blocks=num_blocks, **settings)
    log = log_steps(tight)
    preempted = tight.generate(PREEMPT_PROMPTS, params, use_tqdm=False)
    assert log.preempted, "the tight cache must force preemption"
    assert token_ids(preempted) == token_ids(roomy.generate(PREEMPT_PROMPTS, params, use_tqdm=False))
    assert all(len(o.outputs[0].token_ids) == 24 for o in preempted)
    check_all_free(tight.engine.scheduler)


def test_sliding_window_smaller_than_the_sequence_matches_transformers(model_dirs):
    # Window 8, 20-token prompts and 28 new tokens: 48 tokens span 12 blocks of 4, but with chunks
    # of at most 8 tokens a window of 8 needs ceil((7 + 8) / 4) + 1 = 5 blocks at once.
    prompts = [[(i * 11 + 3) % 250 for i in range(20)], [(i * 29 + 5) % 250 for i in range(20)]]
    settings = dict(max_model_len=64, max_num_batched_tokens=8, block_size=4, num_blocks=6)
    with pytest.raises(ValueError, match="can never fit"):
        make_llm(model_dirs["llama"], **settings).generate(prompts[:1], SamplingParams(max_tokens=28))
    reference = load_hf_reference(model_dirs["mistral"])
    expected = [hf_greedy(reference, p, 28).tokens for p in prompts]
    # The tight cache (5 usable blocks) must serve both; a roomy one, one request at a time, must
    # still hold no more than 5 blocks at once (there, the bound is the window's, not the cache's).
    for num_blocks, max_num_seqs in ((6, 4), (30, 1)):
        llm = make_llm(model_dirs["mistral"], **{**settings, "num_blocks": num_blocks, "max_num_seqs": max_num_seqs})
        log = log_steps(llm)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=28, temperature=0, ignore_eos=True), use_tqdm=False)
        assert log.peak_blocks_in_use <= 5
        assert token_ids(outputs) == expected
        check_all_free(llm.engine.scheduler)
