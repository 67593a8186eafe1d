"""The workload of the fault and thread tests: prompts with shared prefixes on a cache small enough
to preempt, a fresh engine's tokens for them, and how to build the engine; how to inject a fault, and
the check that a failure left nothing behind."""

from __future__ import annotations

import itertools

import pytest

from helpers.core_helpers import check_all_free, token_ids
from helpers.tiny_models import make_tiny_model
from micro_vllm import LLM, SamplingParams

FAMILY = "qwen3_sliding"  # two KV cache groups, one of them a sliding window
SHARED = [(i * 53 + 7) % 250 for i in range(14)]
# Shared prefixes (hits within a call and across calls), lengths that cross block boundaries.
PROMPTS = [SHARED + [1, 2, 3], SHARED + [9], SHARED[:9], [(i * 31) % 250 for i in range(19)], SHARED + [1, 2, 3, 4]]
PARAMS = [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop="t"),  # detokenized each step; stops at 8
    SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
]
# A cache of 14 usable blocks of 4 cannot hold all five requests at once: they preempt each other.
SETTINGS = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=15)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(FAMILY, tmp_path_factory.mktemp("models"))


def make_llm(path, **overrides) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", attention_backend="sdpa", **{**SETTINGS, **overrides})


def record_preemptions(llm: LLM) -> list[str]:
    """The ids of the requests the engine's scheduler preempts from now on, as they happen."""
    preempted: list[str] = []
    schedule = llm.engine.scheduler.schedule

    def logged_schedule():
        plan = schedule()
        preempted.extend(plan.preempted_req_ids)
        return plan

    llm.engine.scheduler.schedule = logged_schedule
    return preempted


def fresh_outputs(path, prompts, params) -> list:
    """A fresh engine's outputs; the run must preempt for the tests to mean anything."""
    llm = make_llm(path)
    preempted = record_preemptions(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert preempted, "the cache must be small enough to preempt"
    return outputs


@pytest.fixture(scope="module")
def expected(model_dir):
    """A fresh engine's tokens for PROMPTS."""
    return token_ids(fresh_outputs(model_dir, PROMPTS, PARAMS))


def roll_back_a_run(llm: LLM) -> None:
    """Start two requests, run three steps, then roll back (as a failed step does): the runners forget
    every request, and the outputs of the steps in flight are never read."""
    engine = llm.engine
    for index in range(2):
        engine.add_request(f"dropped-{index}", PROMPTS[index], PARAMS[index])
    for _ in range(3):
        engine.step()
    engine.abort_all_requests()
    check_all_free(engine.scheduler)


def check_nothing_left(llm: LLM) -> None:
    """No request, block, in-flight step, unconfirmed hash, runner row or prompt record is left."""
    engine = llm.engine
    check_all_free(engine.scheduler)
    assert not engine.scheduler.finished_req_ids
    assert not engine.scheduler.kv_cache_manager.unconfirmed
    assert not engine.in_flight and not engine.prompts and not engine.output_processor.states
    assert not engine.output_processor.parent_requests and not engine.output_processor.parent_of
    runner = engine.executor.worker.model_runner
    assert len(runner.input_batch) == 0 and not runner.input_batch.row_of
    assert runner.prev_sampled_token_ids is None and not runner.prev_req_id_to_index
    assert not runner.prompt_logprobs.in_progress


def inject(patch: pytest.MonkeyPatch, owner, name: str, at_call: int, error: type[BaseException]) -> None:
    """Make ``owner.name`` raise ``error`` on its ``at_call``-th call (counting from 0)."""
    original = getattr(owner, name)
    calls = itertools.count()

    def faulty(*args, **kwargs):
        if next(calls) == at_call:
            raise error(f"injected into {name}")
        return original(*args, **kwargs)

    patch.setattr(owner, name, faulty)
