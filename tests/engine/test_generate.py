"""End to end through LLM -> Engine -> Scheduler -> Executor -> Worker -> ModelRunner, against
transformers, token by token (fp32, CPU, tiny random models)."""

import gc
import weakref

import pytest
import torch

from helpers.core_helpers import check_all_free
from helpers.gpu_helpers import hf_greedy as transformers_greedy
from micro_vllm import LLM, CacheConfig, LLMConfig, ModelConfig, RequestOutputKind, SamplingParams, SchedulerConfig
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
# add (sliding windows, GQA, head_dim != hidden / heads), over the first half of the reference's new
# tokens. Decode steps cost most of the interpreted time, and those of the second half add nothing:
# the first half's steps already hold every kind the whole run has (prefill chunks, chunks beside
# decodes, decode-only batches of 2 and of 4 requests) with the same tile choices, every context
# crossing block boundaries within one decode tile (128 keys).
CASES = [(f, b) for f in FAMILIES for b in ("reference", "sdpa")] + [("mistral", "triton"), ("qwen3", "triton")]
TRITON_NEW_TOKENS = NUM_NEW_TOKENS // 2


@pytest.mark.parametrize("family, backend", CASES)
def test_greedy_matches_transformers(family, backend, model_dirs, hf_greedy):
    llm = _llm(model_dirs[family], backend)
    num_new_tokens = TRITON_NEW_TOKENS if backend == "triton" else NUM_NEW_TOKENS
    params = SamplingParams(max_tokens=num_new_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output, expected in zip(PROMPTS, outputs, hf_greedy(family)):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == expected[:num_new_tokens]
        assert output.outputs[0].finish_reason == "length"
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
        expected = [o.outputs[0].token_ids for o in a.generate(PROMPTS, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in b.generate(PROMPTS, params, use_tqdm=False)] == expected
        assert [o.outputs[0].token_ids for o in c.generate(PROMPTS, params, use_tqdm=False)] == expected


def test_text_prompts_dict_prompts_and_detokenized_output(model_dirs):
    llm = _llm(model_dirs["llama"], "sdpa")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    text, ids, as_dict = llm.generate(
        ["hello", list(b"hello"), {"prompt_token_ids": list(b"hello")}], params, use_tqdm=False
    )
    assert text.prompt == "hello"
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids == as_dict.outputs[0].token_ids
    assert text.outputs[0].text == llm.tokenizer.decode(text.outputs[0].token_ids, skip_special_tokens=True)
    assert [o.request_id for o in (text, ids, as_dict)] == sorted({text.request_id, ids.request_id, as_dict.request_id}, key=int)


def test_generation_stops_at_max_model_len(model_dirs):
    llm = _llm(model_dirs["llama"], "sdpa", max_model_len=40)
    [output] = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3 and output.outputs[0].finish_reason == "length"


def test_eos_stops_generation(model_dirs):
    llm = _llm(model_dirs["llama"], "sdpa")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [free] = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
    stop_at = free.outputs[0].token_ids[3]
    [stopped] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at]),
                             use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(stop_at) + 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dirs):
    llm = _llm(model_dirs["mistral"], "sdpa")
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowded = llm.generate(PROMPTS[1:] + [PROMPTS[0]], [other] * 3 + [seeded], use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == crowded
    reseeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(model_dirs):
    llm = _llm(model_dirs["qwen3"], "sdpa")
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.5, top_k=1, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_greedy_rows_stay_greedy_beside_sampled_rows(model_dirs):
    llm = _llm(model_dirs["llama_untied"], "sdpa")
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.8, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [sampled, greedy, sampled], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("budget", [16, 3])  # 3 < max_num_seqs: some decodes wait steps for budget
def test_async_scheduling_gives_the_same_outputs_as_sync(budget, model_dirs):
    """Planning a step before the last one's tokens are back changes when the host learns a token,
    never which token: greedy and seeded requests match the synchronous engine, requests that stop
    early lose the token planned after their stop, and no block leaks."""
    path = model_dirs["qwen3"]
    free = _llm(path, "sdpa").generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                       use_tqdm=False)
    params = [
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free[0].outputs[0].token_ids[2]]),  # stops early
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
    ]
    runs = []
    for async_scheduling in (True, False):
        llm = _llm(path, "sdpa", max_num_batched_tokens=budget, async_scheduling=async_scheduling)
        outputs = llm.generate(PROMPTS * 2, params * 2, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs])
        check_all_free(llm.engine.scheduler)
        assert not llm.engine.in_flight
    assert runs[0] == runs[1]
    assert runs[0][0] == (free[0].outputs[0].token_ids[:3], "stop")
    assert [len(tokens) for tokens, _ in runs[0][:4]] == [3, 9, 12, 5]


def _stream(engine, prompts, params):
    """Every output ``Engine.step`` gives for the prompts, per request, until all finish."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", prompt, p)
    outputs = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return list(outputs.values())


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_stop_strings_end_requests_mid_flight(async_scheduling, model_dirs):
    """A stop string ends a request at the step that completes it: with async scheduling the step
    planned after it is dropped, as after a stop token; the others go on, and no block leaks."""
    llm = _llm(model_dirs["llama"], "sdpa", async_scheduling=async_scheduling)
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    free = [o.outputs[0] for o in llm.generate(PROMPTS, SamplingParams(**greedy), use_tqdm=False)]
    # A character of the text first seen at least 3 characters in (random bytes: skip U+FFFD).
    text = free[1].text
    at = next(i for i, c in enumerate(text) if i >= 3 and c != "\ufffd" and text.index(c) == i)
    params = [SamplingParams(**greedy, stop=text[at]) if i == 1 else SamplingParams(**greedy) for i in range(4)]
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert (outputs[1].text, outputs[1].finish_reason, outputs[1].stop_reason) == (text[:at], "stop", text[at])
    assert outputs[1].token_ids == free[1].token_ids[:len(outputs[1].token_ids)] and len(outputs[1].token_ids) < 12
    assert [(o.token_ids, o.text) for i, o in enumerate(outputs) if i != 1] == [
        (o.token_ids, o.text) for i, o in enumerate(free) if i != 1]
    check_all_free(llm.engine.scheduler)


def test_streamed_outputs_through_the_engine(model_dirs):
    """DELTA outputs add up to the FINAL_ONLY one, CUMULATIVE ones are each the whole output so far,
    and an aborted streaming request gets a last output with ``finish_reason="abort"``."""
    llm = _llm(model_dirs["llama"], "sdpa")
    engine = llm.engine
    kinds = [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, output_kind=k) for k in kinds]
    final, delta, cumulative = _stream(engine, [PROMPTS[0]] * 3, params)
    [final] = final
    assert len(delta) == len(cumulative) == 6 and [o.finished for o in delta] == [False] * 5 + [True]
    assert [t for o in delta for t in o.outputs[0].token_ids] == final.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == final.outputs[0].text
    tokens = final.outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in cumulative] == [tokens[:i] for i in range(1, 7)]
    assert [o.outputs[0].finish_reason for o in cumulative] == [None] * 5 + ["length"]

    engine.add_request("aborted", PROMPTS[0], params[1])
    streamed = []
    while len(streamed) < 2:
        streamed += engine.step()
    [last] = engine.abort_request("aborted")
    assert last.finished and last.outputs[0].finish_reason == "abort" and not any(o.finished for o in streamed)
    assert [t for o in streamed + [last] for t in o.outputs[0].token_ids] == tokens[:len(streamed)]
    check_all_free(engine.scheduler)


def test_without_detokenize_only_token_ids(model_dirs):
    llm = _llm(model_dirs["llama"], "sdpa")
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=d) for d in (True, False)]
    with_text, without = (o.outputs[0] for o in llm.generate([PROMPTS[1]] * 2, params, use_tqdm=False))
    assert without.token_ids == with_text.token_ids and without.text == "" and with_text.text != ""


def test_an_offline_engine_freezes_the_heap_while_it_generates_and_a_dropped_one_is_freed(model_dirs):
    """An offline LLM takes the heap out of the collector's scans while its steps run (full
    collections would stall them) and puts it back when ``generate`` returns, so the caller's heap
    is collectable between calls (the server's engine process freezes its own for good:
    tests/engine/test_async_llm.py); and an engine that is shut down and dropped is freed by
    reference counting: a reference cycle through it would keep it, and its memory, until a full
    collection."""
    frozen = gc.get_freeze_count()
    llm = _llm(model_dirs["qwen3"], "sdpa")
    step, frozen_in_steps = llm.engine.step, []
    llm.engine.step = lambda: frozen_in_steps.append(gc.get_freeze_count()) or step()
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert frozen_in_steps and min(frozen_in_steps) > frozen
    assert gc.get_freeze_count() == frozen
    del llm.engine.step, step  # the bound method holds the engine
    runner = llm.engine.executor.worker.model_runner
    refs = [weakref.ref(o) for o in (llm.engine, llm.engine.scheduler, runner, runner.model)]
    llm.shutdown()
    gc.disable()  # reference counting alone
    try:
        del llm, runner
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()
