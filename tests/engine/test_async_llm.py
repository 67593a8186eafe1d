"""Outputs cross the pipe whole (a pickled output keeps every field). AsyncLLM on a tiny model:
streamed deltas add up to the offline output, a cancelled caller's request is aborted and its blocks
freed, a refused request fails only its caller, a request that cannot reach the engine is forgotten,
and an engine whose process dies fails every caller and the health check, saying how the process
ended. No shutdown waits forever: a process that does not stop is killed, and one whose parent is
gone ends.

Then the engine process's loop (``EngineCoreProc``) driven over a pipe in this process, its grammar
compiles held until the test lets them go: the other requests step meanwhile, an abort ends a request
still compiling at once, and a grammar that fails to compile fails only its request; and a step held
until the test lets it go: the requests and aborts that come in meanwhile are all applied before the
next step, so that an aborted request is never scheduled."""

import asyncio
import gc
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import replace

import pytest

from micro_vllm import LLM, RequestOutputKind, SamplingParams, StructuredOutputsParams
from micro_vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from micro_vllm.engine import async_llm
from micro_vllm.engine.async_llm import AsyncLLM, EngineDeadError
from micro_vllm.engine.core_proc import EngineCoreProc
from micro_vllm.engine.engine import LLMEngine
from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
from micro_vllm.logprobs import Logprob
from helpers.fault_workload import child_env
from helpers.tiny_models import make_tiny_model, one_torch_thread  # noqa: F401

KWARGS = dict(device="cpu", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
PROMPTS = [[5 + i] * (3 + 4 * i) for i in range(4)]


class RecordingLogger:
    def __init__(self):
        self.scheduler_stats = []

    def record(self, scheduler_stats, iteration_stats):
        if scheduler_stats is not None:
            self.scheduler_stats.append(scheduler_stats)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("async")))


def test_outputs_cross_the_pipe_whole():
    """Outputs pickle as their fields in order (``__reduce__``): every field, none at its default, comes back."""
    logprobs = [{7: Logprob(-0.5, 1, "x")}]
    completion = CompletionOutput(1, "text", [7], -0.5, logprobs, finish_reason="stop", stop_reason="!")
    output = RequestOutput("id", "prompt", [1, 2], [None, {2: Logprob(-1.0, 2, "y")}], [completion], True, 2)
    assert pickle.loads(pickle.dumps(output)) == output


def start_engine(model):
    logger = RecordingLogger()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **KWARGS), stat_loggers=[logger])
    engine.logger = logger
    return engine


@pytest.fixture(scope="module")
def llm(model):
    """One engine process for the module (starting one takes seconds), shared by the tests in file order,
    the last of which stops it; the test that kills it has its own."""
    engine = start_engine(model)
    yield engine
    engine.shutdown()


def last_idle_snapshot(llm, timeout=60):
    """The scheduler snapshot of the engine once nothing runs or waits (every command applied)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        last = llm.logger.scheduler_stats[-1]
        if last.num_running_reqs == last.num_waiting_reqs == 0:
            return last
        time.sleep(0.01)
    raise AssertionError("the engine did not fall idle")


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def collect(llm, prompt, params, request_id):
    return [out async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id)]


def test_concurrent_streams_match_the_offline_outputs(llm, model):
    async def main():
        return await asyncio.gather(*(collect(llm, p, greedy(6), str(i)) for i, p in enumerate(PROMPTS)))

    streamed = asyncio.run(main())
    with LLM(model=model, **KWARGS) as offline:
        expected = offline.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(6), use_tqdm=False)
    for outputs, reference in zip(streamed, expected):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]  # steps may fold together
        assert [t for o in outputs for t in o.outputs[0].token_ids] == reference.outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in outputs) == reference.outputs[0].text


def test_a_caller_that_falls_behind_gets_the_missed_steps_in_one_output(llm, model):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2, logprobs=2)

    async def main():
        stream = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, "slow")
        first = await anext(stream)
        seen = len(llm.logger.scheduler_stats)
        while not any(s.num_running_reqs == s.num_waiting_reqs == 0 for s in llm.logger.scheduler_stats[seen:]):
            await asyncio.sleep(0.01)  # the caller reads nothing until the engine is idle
        return first, [out async for out in stream]

    first, rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished and not first.finished
    with LLM(model=model, **KWARGS) as offline:
        [reference] = offline.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
    for expected in reference.outputs:
        parts = [c for out in (first, rest[0]) for c in out.outputs if c.index == expected.index]
        assert [t for c in parts for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in parts) == expected.text
        streamed = [p for c in parts for p in c.logprobs]  # the engine's process may use other torch threads
        assert [{t: lp.rank for t, lp in p.items()} for p in streamed] == [{t: lp.rank for t, lp in p.items()}
                                                                          for p in expected.logprobs]
        assert [lp.logprob for p in streamed for lp in p.values()] == pytest.approx(
            [lp.logprob for p in expected.logprobs for lp in p.values()], abs=1e-5)
        assert parts[-1].finish_reason == expected.finish_reason == "length"


def test_a_cancelled_caller_aborts_its_request_and_frees_its_blocks(llm):
    async def main():
        started = asyncio.Event()

        async def stream_until_cancelled():
            async for _ in llm.generate({"prompt_token_ids": PROMPTS[2]}, greedy(100), "cancelled"):
                started.set()

        long_task = asyncio.create_task(stream_until_cancelled())
        await started.wait()
        async for closed in llm.generate({"prompt_token_ids": PROMPTS[3]}, greedy(100), "closed"):
            break  # leaving the loop closes the generator: its request is aborted
        long_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long_task
        finished = await collect(llm, PROMPTS[0], greedy(3), "other")
        return closed, finished

    closed, finished = asyncio.run(main())
    assert not closed.finished and finished[-1].finished
    assert last_idle_snapshot(llm).kv_used_blocks == 0
    assert max(s.num_running_reqs for s in llm.logger.scheduler_stats) >= 2


def test_abort_ends_the_callers_stream_and_frees_its_blocks(llm):
    """``await llm.abort(id)`` from elsewhere: the request's caller gets a last output, finished with
    finish_reason "abort", instead of waiting forever."""
    async def main():
        outputs = []
        async for output in llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(100), "aborted"):
            outputs.append(output)
            if len(outputs) == 1:
                await llm.abort("aborted")
        return outputs

    outputs = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert all(not o.finished for o in outputs[:-1])
    assert last_idle_snapshot(llm).kv_used_blocks == 0


def test_a_refused_request_fails_only_its_caller(llm):
    async def main():
        good = asyncio.create_task(collect(llm, PROMPTS[1], greedy(4), "good"))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(llm, [10**6], greedy(4), "bad")
        with pytest.raises(ValueError, match="max_model_len=128"):
            await collect(llm, [1] * 128, greedy(4), "long")
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(llm, PROMPTS[1], greedy(4), "dup"), collect(llm, PROMPTS[1], greedy(4), "dup"))
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outputs) == 4
    llm.check_health()


def test_a_request_that_cannot_reach_the_engine_is_forgotten(llm):
    """A prompt that cannot be sent to the engine's process fails its caller, and its id is free."""
    unsendable = {"prompt_token_ids": PROMPTS[0], "on_done": lambda: None}  # a lambda does not pickle

    async def main():
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            await anext(llm.generate(unsendable, greedy(2), "unsendable"))
        return await collect(llm, PROMPTS[0], greedy(2), "unsendable")

    assert asyncio.run(main())[-1].finished
    assert not llm._streams


def test_shutdown_kills_an_engine_process_that_does_not_stop(llm, monkeypatch):
    """AsyncLLM.shutdown never waits forever: an engine process that does not act on the request
    (stopped here, as one stuck in a step would be) is killed once the timeout has passed. The last
    test of the module's engine: it leaves it shut down."""
    monkeypatch.setattr(async_llm, "SHUTDOWN_TIMEOUT_S", 1)
    os.kill(llm._process.pid, signal.SIGSTOP)
    llm.shutdown()
    assert llm._process.exitcode == -signal.SIGKILL
    assert not llm._reader.is_alive()  # the pipe closed with the process


def test_a_dead_engine_fails_every_caller_and_the_health_check(model):
    """The engine's process dies (killed) while requests stream: each caller gets EngineDeadError."""
    llm = start_engine(model)
    class KillOnFirstTokens:
        def record(self, scheduler_stats, iteration_stats):
            if iteration_stats is not None and iteration_stats.num_generation_tokens and llm._process.is_alive():
                llm._process.kill()

    llm.stat_loggers.append(KillOnFirstTokens())

    async def main():
        results = await asyncio.gather(*(collect(llm, p, greedy(50), str(i)) for i, p in enumerate(PROMPTS)),
                                       return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await collect(llm, PROMPTS[0], greedy(2), "later")
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and str(r) == "the engine process was killed by SIGKILL" for r in results)
    assert llm.errored
    with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
        llm.check_health()
    llm.shutdown()


PARENT = """
import multiprocessing, sys
from helpers.stuck_engine import stuck_engine_process
process = multiprocessing.get_context("spawn").Process(target=stuck_engine_process)
process.start()
print(process.pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_engine_process_ends_with_its_parent():
    """A parent killed before it could shut its AsyncLLM down (SIGKILL: no atexit handler runs) takes
    the engine's process with it, even one stuck in a step, which never reads its pipe again."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=child_env())
    engine_pid = None
    try:
        engine_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while _running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(engine_pid)
    finally:
        parent.kill()
        parent.wait()
        if engine_pid is not None and _running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


# -- the engine process's loop, in this process ---------------------------------------------------


class HeldCompiles:
    """The engine's structured-output manager, each compile held until ``release`` is set; the regex
    "fail" fails to compile, as xgrammar raises from C++."""

    def __init__(self, manager):
        self.manager = manager
        self.started = threading.Event()
        self.release = threading.Event()

    def grammar_init(self, params):
        self.started.set()
        assert self.release.wait(60)
        if params.regex == "fail":
            raise RuntimeError("xgrammar could not compile it")
        return self.manager.grammar_init(params)


class Core:
    """An EngineCoreProc on a thread of this process, driven through its pipe as AsyncLLM drives it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.compiles = HeldCompiles(engine.get_structured_output_manager())
        engine.get_structured_output_manager = lambda: self.compiles
        self.conn, child_conn = multiprocessing.Pipe()
        self.proc = EngineCoreProc(engine, child_conn)
        self.loop = threading.Thread(target=self.proc.run)
        self.loop.start()
        self.received = defaultdict(deque)  # request id -> its outputs and refusals, not yet taken

    def add(self, request_id, prompt, params):
        params = replace(params, output_kind=RequestOutputKind.DELTA)  # as AsyncLLM sends it
        self.conn.send(("add", request_id, {"prompt_token_ids": prompt}, params))

    def receive(self, request_id, timeout=60):
        """The next output of ``request_id``, or the error that refused it."""
        deadline = time.monotonic() + timeout
        while not self.received[request_id]:
            assert self.conn.poll(max(0.0, deadline - time.monotonic())), f"nothing for {request_id!r}"
            message = self.conn.recv()
            if message[0] == "outputs":
                for output in message[1]:
                    self.received[output.request_id].append(output)
            elif message[0] == "refused":
                self.received[message[1]].append(message[2])
        return self.received[request_id].popleft()

    def run_to_the_end(self, request_id):
        outputs = [self.receive(request_id)]
        while not outputs[-1].finished:
            outputs.append(self.receive(request_id))
        return outputs

    def shutdown(self):
        self.compiles.release.set()
        self.conn.send(("shutdown",))
        self.loop.join(timeout=60)
        self.engine.shutdown()
        gc.unfreeze()  # EngineCoreProc froze this test process's heap, as it does its own process's


@pytest.fixture
def core(model):
    core = Core(LLMEngine(EngineArgs(model=model, **KWARGS).create_engine_config()))
    yield core
    core.shutdown()


def test_the_engine_process_freezes_its_start_up_heap(core):
    """The server's engine process moves what start-up made out of the collector's generations, so
    that full collections set off by the steps do not scan it again: the engine's scheduler and model
    are no longer tracked (an offline LLM freezes it only while it generates: test_generate.py)."""
    runner = core.engine.executor.worker.model_runner
    assert gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}
    assert id(core.engine.scheduler) not in tracked and id(runner.model) not in tracked


def digits(regex="[0-9]{3}"):
    return SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(regex=regex))


def num_tokens(outputs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def test_requests_step_while_a_grammar_compiles(core):
    core.add("constrained", PROMPTS[0], digits())
    assert core.compiles.started.wait(60)
    core.add("plain", PROMPTS[1], greedy(6))
    assert num_tokens(core.run_to_the_end("plain")) == 6  # while the grammar is held
    core.compiles.release.set()
    constrained = core.run_to_the_end("constrained")
    text = "".join(o.outputs[0].text for o in constrained)
    assert len(text) == 3 and text.isdigit() and constrained[-1].outputs[0].finish_reason == "stop"


def test_an_abort_ends_a_request_still_compiling(core):
    core.add("compiling", PROMPTS[2], digits())
    assert core.compiles.started.wait(60)
    core.conn.send(("abort", "compiling"))
    aborted = core.receive("compiling")  # at once: the compile is still held
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids == []
    assert aborted.prompt_token_ids == PROMPTS[2]
    core.compiles.release.set()
    core.add("after", PROMPTS[0], greedy(2))
    assert num_tokens(core.run_to_the_end("after")) == 2
    assert not core.received["compiling"]  # its compile's end changed nothing
    assert not core.engine.has_unfinished_requests() and not core.engine.prompts


def test_a_grammar_that_fails_to_compile_fails_only_its_request(core):
    core.compiles.release.set()
    core.add("plain", PROMPTS[1], greedy(20))
    core.add("failing", PROMPTS[0], digits("fail"))
    error = core.receive("failing")
    assert isinstance(error, RuntimeError) and "could not compile" in str(error)
    assert num_tokens(core.run_to_the_end("plain")) == 20
    assert not core.engine.prompts


def test_every_abort_that_came_in_during_a_step_is_applied_before_the_next(core):
    """A burst of requests whose callers leave while a step runs: more adds than the pipe holds, then
    their aborts. The pipe is read during the step, so the sender never waits for the step to end, and
    none of the burst is ever scheduled: every command that has come in is applied before the next
    step is planned, the aborts with the adds."""
    release, held = threading.Event(), threading.Event()
    step, schedule = core.engine.step, core.engine.scheduler.schedule
    scheduled = set()

    def held_step():
        held.set()
        assert release.wait(60)
        return step()

    def recording_schedule():
        plan = schedule()
        scheduled.update(plan.num_scheduled_tokens)
        return plan

    core.engine.step, core.engine.scheduler.schedule = held_step, recording_schedule
    core.add("running", PROMPTS[0], greedy(4))
    assert held.wait(60)
    burst = [f"gone-{i}" for i in range(300)]  # each add is over 300 bytes pickled: 300 fill the pipe

    def send_burst():
        for request_id in burst:
            core.add(request_id, [7] * 120, greedy(4))
        for request_id in burst:
            core.conn.send(("abort", request_id))

    sender = threading.Thread(target=send_burst)
    sender.start()
    sender.join(60)
    try:
        assert not sender.is_alive(), "the sender waited for the step to end"
        deadline = time.monotonic() + 60
        while core.proc.input_queue.qsize() < 2 * len(burst):  # every command read, none applied yet
            assert time.monotonic() < deadline, "the input thread did not read the burst"
            time.sleep(0.01)
    finally:
        release.set()
    assert num_tokens(core.run_to_the_end("running")) == 4
    for request_id in burst:
        [aborted] = core.run_to_the_end(request_id)
        assert aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids == []
    assert scheduled == {"running"}
    assert not core.engine.has_unfinished_requests()
