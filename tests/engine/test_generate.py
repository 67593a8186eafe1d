"""End to end through LLM -> Engine -> Scheduler -> Executor -> Worker -> ModelRunner, against
transformers, token by token (fp32, CPU, tiny random models)."""

import pytest
import torch

from helpers.core_helpers import check_all_free
from helpers.gpu_helpers import hf_greedy as transformers_greedy
from micro_vllm import LLM, CacheConfig, LLMConfig, ModelConfig, SamplingParams, SchedulerConfig
from helpers.tiny_models import FAMILIES, load_hf_reference, make_tiny_model

NUM_NEW_TOKENS = 32
# Lengths that cross block boundaries and do not divide by the block size; the budget forces
# chunked prefill, and decodes of short prompts share steps with chunks of long ones.
PROMPTS = [list(range(3, 40)), [7, 1, 250, 9, 33], [(i * 37) % 250 for i in range(61)], [42]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: make_tiny_model(family, root) for family in FAMILIES}


@pytest.fixture(scope="module")
def hf_greedy(model_dirs):
    cache = {}

    def reference(family):
        if family not in cache:
            model = load_hf_reference(model_dirs[family])
            cache[family] = [transformers_greedy(model, p, NUM_NEW_TOKENS).tokens for p in PROMPTS]
        return cache[family]

    return reference


def _llm(path, backend, **overrides):
    settings = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, block_size=8)
    settings.update(overrides)
    return LLM(model=str(path), device="cpu", dtype="float32", attention_backend=backend, **settings)


# The triton kernels run under Triton's CPU interpreter here, slowly: two families cover what they
# add (sliding windows, GQA, head_dim != hidden / heads).
CASES = [(f, b) for f in FAMILIES for b in ("reference", "sdpa")] + [("mistral", "triton"), ("qwen3", "triton")]


@pytest.mark.parametrize("family, backend", CASES)
def test_greedy_matches_transformers(family, backend, model_dirs, hf_greedy):
    llm = _llm(model_dirs[family], backend)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output, expected in zip(PROMPTS, outputs, hf_greedy(family)):
        assert output.prompt_token_ids == prompt
        assert output.output_token_ids == expected
        assert output.finish_reason == "length"
    check_all_free(llm.engine.scheduler)


def test_config_form_and_keyword_form_agree(model_dirs):
    path = str(model_dirs["qwen3"])
    config = LLMConfig(
        model_config=ModelConfig(model=path, device="cpu", dtype=torch.float32),
        scheduler_config=SchedulerConfig(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4),
        cache_config=CacheConfig(block_size=16),
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(config) as a, LLM(model=path, max_model_len=128, block_size=16, device="cpu") as b, \
            LLM(path, max_model_len=128, block_size=16, device="cpu") as c:
        expected = [o.output_token_ids for o in a.generate(PROMPTS, params, use_tqdm=False)]
        assert [o.output_token_ids for o in b.generate(PROMPTS, params, use_tqdm=False)] == expected
        assert [o.output_token_ids for o in c.generate(PROMPTS, params, use_tqdm=False)] == expected


def test_text_prompts_dict_prompts_and_detokenized_output(model_dirs):
    llm = _llm(model_dirs["llama"], "sdpa")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    text, ids, as_dict = llm.generate(
        ["hello", list(b"hello"), {"prompt_token_ids": list(b"hello")}], params, use_tqdm=False
    )
    assert text.prompt == "hello"
    assert text.output_token_ids == ids.output_token_ids == as_dict.output_token_ids
    assert text.output_text == llm.tokenizer.decode(text.output_token_ids, skip_special_tokens=True)
    assert [o.request_id for o in (text, ids, as_dict)] == sorted({text.request_id, ids.request_id, as_dict.request_id}, key=int)


def test_generation_stops_at_max_model_len(model_dirs):
    llm = _llm(model_dirs["llama"], "sdpa", max_model_len=40)
    [output] = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            use_tqdm=False)
    assert len(output.output_token_ids) == 3 and output.finish_reason == "length"


def test_eos_stops_generation(model_dirs):
    llm = _llm(model_dirs["llama"], "sdpa")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [free] = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
    stop_at = free.output_token_ids[3]
    [stopped] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at]),
                             use_tqdm=False)
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == free.output_token_ids[: free.output_token_ids.index(stop_at) + 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dirs):
    llm = _llm(model_dirs["mistral"], "sdpa")
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].output_token_ids
    crowded = llm.generate(PROMPTS[1:] + [PROMPTS[0]], [other] * 3 + [seeded], use_tqdm=False)[-1].output_token_ids
    assert alone == crowded
    reseeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], reseeded, use_tqdm=False)[0].output_token_ids != alone


def test_top_k_one_is_greedy(model_dirs):
    llm = _llm(model_dirs["qwen3"], "sdpa")
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.5, top_k=1, ignore_eos=True),
                        use_tqdm=False)
    assert [o.output_token_ids for o in greedy] == [o.output_token_ids for o in top1]


def test_greedy_rows_stay_greedy_beside_sampled_rows(model_dirs):
    llm = _llm(model_dirs["llama_untied"], "sdpa")
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.8, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].output_token_ids
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [sampled, greedy, sampled], use_tqdm=False)
    assert mixed[1].output_token_ids == alone


@pytest.mark.parametrize("budget", [16, 3])  # 3 < max_num_seqs: some decodes wait steps for budget
def test_async_scheduling_gives_the_same_outputs_as_sync(budget, model_dirs):
    """Planning a step before the last one's tokens are back changes when the host learns a token,
    never which token: greedy and seeded requests match the synchronous engine, requests that stop
    early lose the token planned after their stop, and no block leaks."""
    path = model_dirs["qwen3"]
    free = _llm(path, "sdpa").generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                       use_tqdm=False)
    params = [
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free[0].output_token_ids[2]]),  # stops early
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
    ]
    runs = []
    for async_scheduling in (True, False):
        llm = _llm(path, "sdpa", max_num_batched_tokens=budget, async_scheduling=async_scheduling)
        runs.append([(o.output_token_ids, o.finish_reason) for o in llm.generate(PROMPTS * 2, params * 2, use_tqdm=False)])
        check_all_free(llm.engine.scheduler)
        assert not llm.engine.in_flight
    assert runs[0] == runs[1]
    assert runs[0][0] == (free[0].output_token_ids[:3], "stop")
    assert [len(tokens) for tokens, _ in runs[0][:4]] == [3, 9, 12, 5]
