"""Parallel sampling (``SamplingParams.n > 1``) end to end: a request's n sequences share the prompt's
KV blocks and compute the prompt once, sequence i is what the prompt alone gives with seed + i, and
the sequences come back as one RequestOutput per request in every output kind, through aborts,
preemption and faults. A tiny random model on CPU (fp32, sdpa)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.core_helpers import check_all_free, token_ids
from helpers.fault_workload import PARAMS, PROMPTS, check_nothing_left, fresh_outputs, inject, make_llm
from helpers.fault_workload import model_dir  # noqa: F401  (a fixture)
from helpers.gpu_helpers import hf_greedy
from helpers.tiny_models import load_hf_reference
from helpers.tiny_models import one_torch_thread  # noqa: F401  (an autouse fixture)
from micro_vllm import RequestOutputKind, SamplingParams

N = 3
BLOCK_SIZE = 4  # the fault workload's
ROOMY = dict(num_blocks=64, max_num_seqs=8)  # no preemption
PROMPT = [(i * 53 + 7) % 250 for i in range(30)]  # two chunks under the budget of 16
# Random sequences that stop at any of these tokens end at different steps.
SEEDED = SamplingParams(n=N, temperature=1.0, seed=7, max_tokens=8, stop_token_ids=range(0, 260, 11))
# The fault workload with several sequences for some prompts: seeded, greedy, and one with a stop string.
N_PARAMS = [replace(params, n=n) for params, n in zip(PARAMS, (2, 3, 2, 2, 1))]


def sequences(outputs) -> list[list[list[int]]]:
    """Each request output's sequences' token ids, checked to come in index order."""
    assert all([c.index for c in o.outputs] == list(range(len(o.outputs))) for o in outputs)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("prompt_len, caching", [(13, True), (30, True), (30, False)])
def test_the_sequences_share_the_prompt_blocks_and_compute_it_once(model_dir, prompt_len, caching, async_scheduling):
    """The first sequence computes the prompt, in two chunks for 30 tokens; the others reuse its full
    blocks and compute only the rest. With prefix caching off each computes the whole prompt."""
    engine = make_llm(model_dir, async_scheduling=async_scheduling, enable_prefix_caching=caching, **ROOMY).engine
    kv = engine.scheduler.kv_cache_manager
    engine.add_request("p", PROMPT[:prompt_len], replace(SEEDED, stop_token_ids=()))
    num_shared = (prompt_len - 1) // BLOCK_SIZE  # a hit never covers the last token
    prefill, compared = 0, False
    while engine.has_unfinished_requests():
        engine.step()
        prefill += engine.last_step_stats.num_prefill_tokens
        tables = [kv.get_block_ids(f"{i}_p")[0] for i in range(N)]  # the full-attention group's
        if all(tables):
            assert len({tuple(table[:num_shared]) for table in tables}) == (1 if caching else N)
            compared = True
    assert compared
    assert prefill == (prompt_len + (N - 1) * (prompt_len - num_shared * BLOCK_SIZE) if caching else N * prompt_len)
    check_all_free(engine.scheduler)


@pytest.fixture(scope="module")
def alone(model_dir):
    """Sequence i's reference: the prompt alone, with n=1 and seed + i."""
    llm = make_llm(model_dir, **ROOMY)
    outputs = llm.generate([PROMPT] * N, [replace(SEEDED, n=1, seed=SEEDED.seed + i) for i in range(N)],
                           use_tqdm=False)
    completions = [(c.token_ids, c.text, c.finish_reason) for c in (o.outputs[0] for o in outputs)]
    assert len({len(tokens) for tokens, _, _ in completions}) > 1, "the sequences must end at different steps"
    return completions


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda kind: kind.name)
def test_each_output_kind_gives_one_output_per_step_with_the_sequences_alone_results(
    model_dir, alone, kind, async_scheduling
):
    engine = make_llm(model_dir, async_scheduling=async_scheduling, **ROOMY).engine
    engine.add_request("p", PROMPT, replace(SEEDED, output_kind=kind))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    assert all(len(step) <= 1 for step in steps)
    outputs = [output for step in steps for output in step]
    assert {output.request_id for output in outputs} == {"p"}
    assert [output.finished for output in outputs] == [False] * (len(outputs) - 1) + [True]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    if kind is RequestOutputKind.DELTA:
        completions = [([], "", None) for _ in range(N)]
        for output in outputs:
            indices = [c.index for c in output.outputs]
            assert indices and indices == sorted(set(indices))  # only the sequences that moved, in order
            for c in output.outputs:
                tokens, text, reason = completions[c.index]
                assert reason is None, "a finished sequence came again"
                completions[c.index] = (tokens + c.token_ids, text + c.text, c.finish_reason)
    else:
        for before, after in zip(outputs, outputs[1:]):  # every sequence in each, growing
            for b, a in zip(before.outputs, after.outputs, strict=True):
                assert a.token_ids[: len(b.token_ids)] == b.token_ids and a.text.startswith(b.text)
        completions = [(c.token_ids, c.text, c.finish_reason) for c in outputs[-1].outputs]
        assert [c.index for c in outputs[-1].outputs] == list(range(N))
    assert completions == alone
    check_all_free(engine.scheduler)


def test_unseeded_sequences_draw_apart(model_dir):
    [output] = make_llm(model_dir, **ROOMY).generate(PROMPT, replace(SEEDED, seed=None), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in output.outputs}) == N


def test_generate_returns_each_prompts_sequences_in_order_and_greedy_ones_are_transformers(model_dir):
    llm = make_llm(model_dir, **ROOMY)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:9], [5, 6, 7]]
    ns = [3, 1, 2]
    outputs = llm.generate(prompts, [replace(greedy, n=n) for n in ns], use_tqdm=False)
    reference = load_hf_reference(model_dir)
    assert [o.request_id for o in outputs] == ["0", "1", "2"]
    assert sequences(outputs) == [[hf_greedy(reference, p, 10).tokens] * n for p, n in zip(prompts, ns)]
    assert all(o.finished and o.prompt_token_ids == p for o, p in zip(outputs, prompts))
    check_all_free(llm.engine.scheduler)


def test_abort_ends_every_sequence_of_the_request(model_dir):
    engine = make_llm(model_dir, **ROOMY).engine
    long = replace(SEEDED, stop_token_ids=(), max_tokens=20)
    engine.add_request("waiting", PROMPT, replace(long, output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("running", PROMPT, long)
    engine.add_request("other", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    [waiting] = engine.abort_request("waiting")
    assert waiting.finished and [(c.index, c.token_ids, c.finish_reason) for c in waiting.outputs] == [
        (i, [], "abort") for i in range(N)]
    for _ in range(4):
        engine.step()
    kv = engine.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    [running] = engine.abort_request(["running"])  # vLLM passes a list of ids
    assert running.request_id == "running" and running.finished
    assert [c.index for c in running.outputs] == list(range(N))
    assert all(c.finish_reason == "abort" and c.token_ids for c in running.outputs)
    assert kv.num_free_blocks > free_before
    assert engine.abort_request("running") == []
    later = []
    while engine.has_unfinished_requests():
        later += engine.step()
    assert {o.request_id for o in later} == {"other"}
    assert not engine.output_processor.parent_requests and not engine.output_processor.parent_of
    check_all_free(engine.scheduler)


def test_ids_in_use_are_refused(model_dir):
    engine = make_llm(model_dir).engine
    engine.add_request("p", PROMPT, SEEDED)
    for request_id, n in (("p", 1), ("p", 2), ("1_p", 1)):
        with pytest.raises(ValueError, match=f"request_id='{request_id}' is already in use"):
            engine.add_request(request_id, [1, 2], replace(SEEDED, n=n))
    engine.abort_all_requests()


@pytest.fixture(scope="module")
def n_expected(model_dir):
    """A fresh engine's sequences for the fault workload with N_PARAMS (a run that preempts)."""
    return sequences(fresh_outputs(model_dir, PROMPTS, N_PARAMS))


def test_under_preemption_each_sequence_is_its_prompt_alone(model_dir, n_expected):
    prompts = [prompt for prompt, params in zip(PROMPTS, N_PARAMS) for _ in range(params.n)]
    params = [replace(p, n=1, seed=None if p.seed is None else p.seed + i) for p in N_PARAMS for i in range(p.n)]
    assert [s for request in n_expected for s in request] == token_ids(make_llm(model_dir).generate(
        prompts, params, use_tqdm=False))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_fault_leaves_nothing_behind(model_dir, n_expected, async_scheduling):
    llm = make_llm(model_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    layer = engine.executor.worker.model_runner.model.model.layers[1]
    faults = [(engine.scheduler, "schedule", 4), (layer, "forward", 9), (engine.output_processor, "gather", 6),
              (engine.output_processor, "finish", 2)]
    for owner, name, at_call in faults:
        with pytest.MonkeyPatch.context() as patch:
            inject(patch, owner, name, at_call, RuntimeError)
            with pytest.raises(RuntimeError, match="injected"):
                llm.generate(PROMPTS, N_PARAMS, use_tqdm=False)
        check_nothing_left(llm)
        assert sequences(llm.generate(PROMPTS, N_PARAMS, use_tqdm=False)) == n_expected


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE], ids=lambda kind: kind.name)
def test_prompt_logprobs_come_once_per_request(model_dir, kind):
    """The sequences share one prompt: DELTA outputs give its logprobs once (whichever sequence
    samples first), CUMULATIVE ones every time, always the whole prompt's."""
    engine = make_llm(model_dir, **ROOMY).engine
    params = replace(SEEDED, output_kind=kind, prompt_logprobs=2, logprobs=1)
    engine.add_request("p", PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    given = [o.prompt_logprobs for o in outputs if o.prompt_logprobs]
    assert len(given) == (1 if kind is RequestOutputKind.DELTA else len(outputs))
    assert all(len(p) == len(PROMPT) and p[0] is None for p in given)
    assert all(token in top for p in given for token, top in zip(PROMPT[1:], p[1:]))
