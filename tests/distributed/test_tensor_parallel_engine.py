"""The engine with tensor_parallel_size=2 on CPU (two gloo ranks, a worker process each), against the
same model on one rank in the engine's process, in fp32: the fault tests' workload (chunked prefill,
prefix hits, preemption, seeded sampling, stop strings) gives the same tokens; so do logprobs (their
values within fp32 tolerance), n > 1, structured output and a batch with an aborted request. A killed
worker fails the engine with EngineDeadError and leaves no process; a split the model cannot make is
refused before any process starts.

The model is Qwen3 with one KV head (replicated on both ranks), q/k norm and a sliding window on one
of its two layers (two KV cache groups). One TP = 2 engine serves the module, its tests in file order:
the last of them kills a worker. (Every family's sharding: test_tensor_parallel_model.py.)
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import re
import signal

import pytest

from helpers.core_helpers import check_all_free, token_ids
from helpers.fault_workload import PARAMS, PROMPTS, expected, make_llm, record_preemptions  # noqa: F401
from helpers.tiny_models import make_tiny_model
from micro_vllm import LLM, SamplingParams, StructuredOutputsParams
from micro_vllm.engine import engine as engine_module
from micro_vllm.engine.exceptions import EngineDeadError
from micro_vllm.executor.multiproc_executor import MultiprocExecutor

LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The fault workload's family with one KV head: fewer than the ranks."""
    return make_tiny_model("qwen3_sliding", tmp_path_factory.mktemp("models"), num_key_value_heads=1,
                           name="qwen3_sliding-one-kv-head")


@pytest.fixture(scope="module")
def one_rank(model_dir):
    llm = make_llm(model_dir)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def two_ranks(model_dir):
    llm = make_llm(model_dir, tensor_parallel_size=2, disable_log_stats=False)  # prefix_cache_hits
    yield llm
    llm.shutdown()


def prefix_cache_hits(llm: LLM) -> int:
    return next(metric.value for metric in llm.get_metrics() if metric.name == "vllm:prefix_cache_hits")


def test_the_fault_workload_gives_the_one_rank_tokens(two_ranks, expected):
    executor = two_ranks.engine.executor
    assert isinstance(executor, MultiprocExecutor) and len(executor.workers) == 2
    preempted = record_preemptions(two_ranks)
    hits = prefix_cache_hits(two_ranks)
    assert token_ids(two_ranks.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    assert preempted and prefix_cache_hits(two_ranks) > hits
    check_all_free(two_ranks.engine.scheduler)


def test_logprobs_equal_one_rank(two_ranks, one_rank):
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=2)]
    prompts = PROMPTS[:2]
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (two_ranks, one_rank))
    assert token_ids(got) == token_ids(want)
    for ours, theirs in zip(got, want):
        for position, (a, b) in enumerate(zip(all_logprobs(ours), all_logprobs(theirs), strict=True)):
            assert a.keys() == b.keys(), position
            for token in a:
                assert a[token].rank == b[token].rank
                assert abs(a[token].logprob - b[token].logprob) <= LOGPROB_TOLERANCE, (position, token)


def all_logprobs(output) -> list[dict]:
    """A request's prompt logprobs (where it asked for them; none for the first token), then its sampled ones."""
    return (output.prompt_logprobs or [None])[1:] + output.outputs[0].logprobs


def test_n_structured_output_and_an_abort_equal_one_rank(two_ranks, one_rank):
    phone, cities = r"[0-9]{3}-[0-9]{4}", ["Paris", "London", "Berlin"]
    requests = [
        (PROMPTS[0], SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)),
        ("Phone: ", SamplingParams(max_tokens=12, temperature=0,
                                   structured_outputs=StructuredOutputsParams(regex=phone))),
        ("City: ", SamplingParams(max_tokens=12, temperature=0.7, seed=2,
                                  structured_outputs=StructuredOutputsParams(choice=cities))),
        (PROMPTS[3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),  # aborted
    ]
    outputs = [run_and_abort_the_last(llm, requests) for llm in (two_ranks, one_rank)]
    assert outputs[0] == outputs[1]
    completions = outputs[0]
    assert len(completions["0"]) == 3
    (_, number, _), (_, city, _) = completions["1"][0], completions["2"][0]
    assert re.fullmatch(phone, number) and city in cities
    assert [reason for *_, reason in completions["3"]] == ["abort"]


def run_and_abort_the_last(llm: LLM, requests: list) -> dict[str, list[tuple]]:
    """Run ``requests`` (request ids "0", "1", ...) through the engine's steps, aborting the last one
    after two steps: each request's completions as (token ids, text, finish reason). Every block is
    free afterwards."""
    engine = llm.engine
    for index, (prompt, params) in enumerate(requests):
        engine.add_request(str(index), prompt, params)
    finished, steps = [], 0
    while engine.has_unfinished_requests():
        finished += [output for output in engine.step() if output.finished]
        steps += 1
        if steps == 2:
            finished += engine.abort_request(str(len(requests) - 1))
    check_all_free(engine.scheduler)
    return {output.request_id: [(c.token_ids, c.text, c.finish_reason) for c in output.outputs] for output in finished}


def test_a_ctrl_c_after_one_rank_got_a_step_reaches_the_other_rank_first(two_ranks, expected, monkeypatch):
    """A Ctrl-C right after rank 0 was sent a step's plan: rank 1 is sent it too before the
    KeyboardInterrupt comes out (without it rank 0 would wait in the step's collectives forever, and
    the rollback for rank 0), and the next call gives the one-rank tokens."""
    commands = two_ranks.engine.executor.workers[0].commands
    send_bytes = commands.send_bytes
    steps = itertools.count()

    def then_ctrl_c(data):
        send_bytes(data)
        if pickle.loads(data)[0] == "execute_model" and next(steps) == 2:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(commands, "send_bytes", then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        two_ranks.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert token_ids(two_ranks.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    check_all_free(two_ranks.engine.scheduler)


def test_a_killed_worker_fails_the_engine_and_leaves_no_process(two_ranks):
    engine = two_ranks.engine
    workers = engine.executor.workers
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"request-{index}", prompt, PARAMS[index])
    engine.step()
    os.kill(workers[1].process.pid, signal.SIGKILL)  # rank 0 waits for it in a collective
    with pytest.raises(EngineDeadError, match="worker rank 1 .* exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    check_all_free(engine.scheduler)
    assert not [worker for worker in workers if worker.process.is_alive()]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("micro-vllm-worker")]


@pytest.mark.parametrize("ranks, overrides, message", [
    (2, dict(num_attention_heads=3), "num_attention_heads=3 is not divisible by tensor_parallel_size=2"),
    (2, dict(num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads=3 is not divisible by "
     "tensor_parallel_size=2"),
    (4, dict(num_attention_heads=12, num_key_value_heads=3), "num_key_value_heads=3 cannot be spread over "
     "tensor_parallel_size=4: one must be a multiple of the other"),
    (2, dict(intermediate_size=129), "intermediate_size=129 is not divisible by tensor_parallel_size=2"),
])
def test_a_split_the_model_cannot_make_is_refused_before_any_process_starts(model_dir, monkeypatch, ranks,
                                                                            overrides, message):
    def no_executor(*args):
        raise AssertionError("the executor was built: its worker processes would start")

    monkeypatch.setattr(engine_module, "MultiprocExecutor", no_executor)
    with pytest.raises(ValueError, match=message):
        make_llm(model_dir, tensor_parallel_size=ranks, hf_overrides=overrides)
