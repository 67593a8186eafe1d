"""The workload of the fault and thread tests: prompts with shared prefixes on a cache small enough
to preempt, a fresh engine's tokens for them, and how to build the engine; how to inject a fault, and
the check that a failure left nothing behind; and a child process that runs ``generate`` under real
SIGINTs (``SigintChild``), for the Ctrl-C tests."""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

import micro_vllm
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


# -- real Ctrl-Cs, in a child process ------------------------------------------------------------

# The Ctrl-C stress test adds text prompts (tokenized when checked) with stop strings (detokenized
# every step) to the workload above, so that an interrupt can land in every phase of a call.
TEXT_PROMPTS = ["The quick brown fox jumps", "Once upon a time, in a land"]
TEXT_PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["zz", "q"]),
    SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, stop="e!"),
]
WORKLOADS = {"faults": (PROMPTS, PARAMS), "every_phase": (PROMPTS + TEXT_PROMPTS, PARAMS + TEXT_PARAMS)}


def sigint_child(model: str, workload: str, num_interrupts: str) -> None:
    """The child of ``SigintChild``: ``generate`` on a workload of ``WORKLOADS`` in a loop, until it has
    taken ``num_interrupts`` KeyboardInterrupts. It prints "ready SECONDS" (how long a call takes),
    then for each interrupt "interrupted WHERE" (the innermost frame of micro_vllm the interrupt left,
    as "path:function" under the package, or "-" for none), and last a JSON line: the calls completed,
    those whose tokens differ from a fresh engine's, what any interrupt left behind, and the prefix
    cache hits of a call after all that. SIGUSR1 makes it print every thread's stack (faulthandler)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    prompts, params = WORKLOADS[workload]
    expected = token_ids(make_llm(model).generate(prompts, params, use_tqdm=False))
    llm = make_llm(model)
    modes = _torch_modes()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    result = {"completed": 0, "mismatches": 0, "left_behind": []}
    # Between calls the child's own bookkeeping holds a SIGINT back (one sent right after the answer
    # to the last, say) and raises it once the next call is about to start.
    held_back = []
    hold_back = lambda signum, frame: held_back.append(signum)  # noqa: E731
    signal.signal(signal.SIGINT, hold_back)
    print(f"ready {time.perf_counter() - start:.4f}", flush=True)
    interrupts = 0
    while interrupts < int(num_interrupts):
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if held_back:
                held_back.clear()
                raise KeyboardInterrupt
            outputs = llm.generate(prompts, params, use_tqdm=False)
            signal.signal(signal.SIGINT, hold_back)
        except KeyboardInterrupt as interrupt:
            signal.signal(signal.SIGINT, hold_back)
            interrupts += 1
            where = _innermost_package_frame(interrupt)
            problems = _left_behind(llm, modes)
            if problems:
                result["left_behind"].append(f"{where}: {', '.join(problems)}")
            print("interrupted", where, flush=True)
            continue
        result["completed"] += 1
        result["mismatches"] += token_ids(outputs) != expected
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result["mismatches"] += token_ids(llm.generate(prompts, params, use_tqdm=False)) != expected
    result["hits"] = sum(o.num_cached_tokens for o in llm.generate(prompts, params, use_tqdm=False))
    print(json.dumps(result), flush=True)


def _torch_modes() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _left_behind(llm: LLM, modes: tuple[bool, bool]) -> list[str]:
    """What an interrupted call left that a fresh engine would not have: a request, a block held,
    a runner row the next plan would not drop, a lock held, torch's grad or inference mode changed."""
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    rows = set(engine.executor.worker.model_runner.input_batch.row_of)
    checks = {
        "requests": engine.scheduler.requests or engine.in_flight or engine.prompts or engine.output_processor.states,
        "blocks": kv.num_free_blocks != kv.num_usable_blocks,
        "runner rows": not rows <= engine.scheduler.finished_req_ids,
        "generate's state": llm._generate_lock.locked() or llm._abort_lock.locked() or llm._generating_thread,
        "torch modes": _torch_modes() != modes,
    }
    return [name for name, failed in checks.items() if failed]


def _innermost_package_frame(error: BaseException) -> str:
    package = Path(micro_vllm.__file__).parent
    where = "-"
    for frame, _ in traceback.walk_tb(error.__traceback__):
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(package):
            where = f"{path.relative_to(package)}:{frame.f_code.co_name}"
    return where


def child_env() -> dict[str, str]:
    """The environment of a test's child process: it imports the micro_vllm the test runs, and the
    tests' helpers."""
    paths = [Path(micro_vllm.__file__).parents[1], Path(__file__).parents[1], os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}


class SigintChild:
    """``sigint_child`` in a process of its own, and the SIGINTs sent to it. Every wait is bounded: a
    child that does not answer within ``timeout`` seconds is asked for every thread's stack, and the
    test fails with them and the rest of the child's stderr."""

    def __init__(self, model_dir, workload: str, num_interrupts: int, stderr_path: Path,
                 timeout: float = 120) -> None:
        self.stderr_path = stderr_path
        self.timeout = timeout
        with open(stderr_path, "wb") as stderr:  # unbuffered stdout, so that select sees every line
            self.process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from helpers.fault_workload import sigint_child; "
                 "sigint_child(*sys.argv[1:])", str(model_dir), workload, str(num_interrupts)],
                stdout=subprocess.PIPE, stderr=stderr, bufsize=0, env=child_env(),
            )
        # Start-up builds two engines, which on a loaded machine takes minutes.
        kind, _, seconds = self.read_line(timeout=5 * timeout).partition(" ")
        assert kind == "ready", kind
        self.call_seconds = float(seconds)  # how long one call of the workload takes

    def interrupt(self) -> str:
        """Send a SIGINT and return where the child's KeyboardInterrupt came from."""
        self.process.send_signal(signal.SIGINT)
        kind, _, where = self.read_line().partition(" ")
        assert kind == "interrupted", kind
        return where

    def result(self) -> dict:
        result = json.loads(self.read_line())
        assert self.process.wait(timeout=self.timeout) == 0
        return result

    def read_line(self, timeout: float | None = None) -> str:
        timeout = timeout or self.timeout
        if not select.select([self.process.stdout], [], [], timeout)[0]:
            self.process.send_signal(signal.SIGUSR1)  # faulthandler writes the stacks at once
            time.sleep(2)
            self.close()
            pytest.fail(f"the child did not answer within {timeout} s; its threads and stderr:\n{self._stderr()}")
        line = self.process.stdout.readline().decode().strip()
        if not line:
            self.close()
            pytest.fail(f"the child exited with {self.process.returncode}; its stderr:\n{self._stderr()}")
        return line

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()

    def _stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-20000:]
