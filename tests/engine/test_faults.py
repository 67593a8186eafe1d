"""Faults never corrupt: whatever raises inside a step (an exception or a KeyboardInterrupt, at any
stage, at any step), the engine aborts the call's requests, frees every block, forgets the prefix-cache
hashes of K/V the failed steps never computed, and then gives exactly a fresh engine's outputs.

Tiny random models on CPU (fp32, sdpa), prefix caching on and a cache small enough to preempt.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tqdm import std as tqdm_std

from helpers.core_helpers import FakeRunner, check_all_free, make_request, make_scheduler, token_ids
from micro_vllm import LLM
from micro_vllm.engine import output_processor
from micro_vllm.worker.step_output import DeviceStepOutput
from helpers.fault_workload import PARAMS, PROMPTS, SETTINGS, SigintChild, check_nothing_left, inject
from helpers.fault_workload import expected, make_llm, model_dir  # noqa: F401  (fixtures)
from helpers.tiny_models import one_torch_thread  # noqa: F401  (an autouse fixture)

@pytest.fixture(scope="module")
def llms(model_dir):
    """One LLM per scheduling mode, shared by every example: faults pile up on the same engine."""
    return {async_scheduling: make_llm(model_dir, async_scheduling=async_scheduling) for async_scheduling in (True, False)}


def stage_target(llm: LLM, stage: str):
    """The object and attribute that a fault at ``stage`` replaces."""
    engine = llm.engine
    runner = engine.executor.worker.model_runner
    return {
        "schedule": (engine.scheduler, "schedule"),
        "allocate_slots": (engine.scheduler.kv_cache_manager, "allocate_slots"),  # in the middle of a plan
        "update_states": (runner, "update_states"),  # before the runner applied the plan
        "prepare_inputs": (runner, "prepare_inputs"),
        "layer_0": (runner.model.model.layers[0], "forward"),
        "layer_1": (runner.model.model.layers[1], "forward"),
        "sampler": (runner, "sample"),
        "get_output": (DeviceStepOutput, "get_output"),
        "update_from_output": (engine.scheduler, "update_from_output"),
        "process_step": (engine.output_processor, "process_step"),  # stop strings and streaming
        "make_output": (engine.output_processor, "finish"),
        "decode": (output_processor, "decode_output"),  # detokenization at the end
    }[stage]


STAGES = ("schedule", "allocate_slots", "update_states", "prepare_inputs", "layer_0", "layer_1", "sampler",
          "get_output", "update_from_output", "process_step", "make_output", "decode")


@settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stage=st.sampled_from(STAGES),
    at_call=st.integers(0, 40),
    error=st.sampled_from([RuntimeError, KeyboardInterrupt]),
    async_scheduling=st.booleans(),
)
def test_a_fault_at_any_stage_of_any_step_leaves_the_engine_correct(llms, expected, stage, at_call, error,
                                                                     async_scheduling):
    llm = llms[async_scheduling]
    assert llm.reset_prefix_cache()  # each example starts from the same state, so failures replay
    with pytest.MonkeyPatch.context() as patch:
        inject(patch, *stage_target(llm, stage), at_call, error)
        try:
            outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        except error as raised:
            assert "injected" in str(raised)
            check_nothing_left(llm)
        else:  # the run had fewer calls than at_call
            assert token_ids(outputs) == expected
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    check_all_free(llm.engine.scheduler)
    assert not llm.engine.scheduler.kv_cache_manager.unconfirmed  # every step planned was confirmed


def test_a_failed_step_does_not_poison_the_prefix_cache(model_dir, expected):
    """A step's blocks are hashed when it is planned; if the step fails before computing their K/V,
    a request with the same prefix must not reuse them."""
    llm = make_llm(model_dir)
    runner = llm.engine.executor.worker.model_runner
    with pytest.MonkeyPatch.context() as patch:
        inject(patch, runner.model.model.layers[0], "forward", 0, RuntimeError)  # the very first step
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert outputs[0].num_cached_tokens == 0  # as in a fresh engine: nothing was computed before


def test_steps_that_fail_before_the_runner_applies_the_plan_leave_no_rows(model_dir, expected):
    """More failed steps than the runner has rows, each after a plan admitted requests."""
    llm = make_llm(model_dir)
    runner = llm.engine.executor.worker.model_runner
    for _ in range(2 * SETTINGS["max_num_seqs"] + 1):
        with pytest.MonkeyPatch.context() as patch:
            inject(patch, runner, "update_states", 1, RuntimeError)
            with pytest.raises(RuntimeError, match="injected"):
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        check_nothing_left(llm)
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


def test_failed_steps_keep_the_hashes_of_confirmed_steps():
    """In the core: a reset forgets the hashes of steps whose output was never applied, and keeps
    those of steps that completed, so a later request still hits them."""
    for async_scheduling, expected_hit in ((True, 0), (False, 8)):
        scheduler = make_scheduler(block_size=4)
        runner = FakeRunner(scheduler, async_scheduling=async_scheduling)
        scheduler.add_request(make_request(list(range(12))))
        runner.step()  # plans and computes the whole prompt; with async scheduling not applied yet
        assert len(scheduler.kv_cache_manager.unconfirmed) == (1 if async_scheduling else 0)
        [aborted] = scheduler.reset()
        assert aborted.finish_reason == "abort"
        check_all_free(scheduler)
        assert not scheduler.kv_cache_manager.unconfirmed
        _, hit = scheduler.kv_cache_manager.get_computed_blocks(make_request(list(range(12))))
        assert hit == expected_hit


def test_rejected_calls_leave_no_records(model_dir):
    llm = make_llm(model_dir)
    for _ in range(3):
        with pytest.raises(ValueError):
            llm.generate([[1, 2, 3], []], use_tqdm=False)  # the second prompt is empty
    check_nothing_left(llm)


# -- a real Ctrl-C -------------------------------------------------------------------------------

NUM_INTERRUPTS = 6


def test_real_sigint_during_generate(model_dir, tmp_path):
    """SIGINTs at random moments of a loop of generate calls, in a child process: each surfaces as
    a KeyboardInterrupt, leaves nothing behind, and every later call gives a fresh engine's tokens.
    A child that does not answer has its threads' stacks in the failure (``SigintChild``);
    tests/engine/test_sigint_stress.py sends thousands."""
    child = SigintChild(model_dir, "faults", NUM_INTERRUPTS, tmp_path / "child_stderr.txt")
    try:
        delays = random.Random(0)
        for _ in range(NUM_INTERRUPTS):
            # The child acknowledges each interrupt before the next, so each lands in its loop.
            time.sleep(delays.uniform(0.05, 0.6))
            child.interrupt()
        result = child.result()
    finally:
        child.close()
    assert result["mismatches"] == 0 and result["left_behind"] == []
    assert result["hits"] > 0  # the prefix cache still serves what completed steps computed


def test_an_interrupt_before_the_next_call_runs_leaves_nothing_behind(model_dir, expected, monkeypatch):
    """A Ctrl-C while the next call still checks its prompts, after a call that completed: the runner
    still holds the requests that finished last, which only the next plan would have dropped; the
    rollback drops them, and the call after gives a fresh engine's tokens."""
    llm = make_llm(model_dir)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(llm.engine.executor.worker.model_runner.input_batch)  # what the next plan would drop
    inject(monkeypatch, llm.engine, "make_request", at_call=0, error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    check_nothing_left(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected


def _tqdm_lock_is_free() -> bool:
    """Whether another thread can take tqdm's process-wide lock now."""
    free = []

    def probe():
        locks = tqdm_std.tqdm.get_lock().locks
        taken = [lock for lock in locks if lock.acquire(False)]
        for lock in taken:
            lock.release()
        free.append(len(taken) == len(locks))

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return free[0]


@pytest.mark.parametrize("where", ["acquire", "__del__"])
def test_a_ctrl_c_while_tqdm_runs_comes_out_after_it(model_dir, expected, monkeypatch, where):
    """tqdm takes its process-wide lock without a ``try`` and a KeyboardInterrupt in its ``__del__`` is
    lost, so generate holds a Ctrl-C back while tqdm runs: one that comes right after tqdm took its
    lock, or while the bar is dropped, ends the call with a KeyboardInterrupt and leaves the lock free."""
    llm = make_llm(model_dir)
    owner = tqdm_std.TqdmDefaultWriteLock if where == "acquire" else tqdm_std.tqdm
    original = getattr(owner, where)
    sent = []

    def then_ctrl_c(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(owner, where, then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    assert sent and _tqdm_lock_is_free()
    check_nothing_left(llm)
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


@pytest.mark.parametrize("second", ["abort_all_requests", "reset"])
def test_a_second_interrupt_in_the_rollback_is_finished_by_the_next_call(model_dir, expected, monkeypatch, second):
    """A Ctrl-C between two steps, and a second one as the rollback of the first starts (before it has
    done anything) or in the middle of it (as the scheduler resets): the rollback is finished when the
    engine is next used, and the next call gives a fresh engine's tokens."""
    llm = make_llm(model_dir)
    inject(monkeypatch, llm, "_apply_aborts", at_call=2, error=KeyboardInterrupt)  # two steps have run
    inject(monkeypatch, llm.engine if second == "abort_all_requests" else llm.engine.scheduler, second,
           at_call=0, error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt, match=second):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    check_all_free(llm.engine.scheduler)
