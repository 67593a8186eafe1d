"""AsyncLLM on a tiny model: streamed deltas add up to the offline output, a cancelled caller's
request is aborted and its blocks freed, a refused request fails only its caller, and an engine
whose process dies fails every caller and the health check."""

import asyncio
import time

import pytest

from micro_vllm import LLM, SamplingParams
from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.async_llm import AsyncLLM, EngineDeadError
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


def start_engine(model):
    logger = RecordingLogger()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **KWARGS), stat_loggers=[logger])
    engine.logger = logger
    return engine


@pytest.fixture(scope="module")
def llm(model):
    """One engine process for the module (starting one takes seconds); the test that kills it has its own."""
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
    assert all(isinstance(r, EngineDeadError) and "process exited" in str(r) for r in results)
    assert llm.errored
    with pytest.raises(EngineDeadError, match="process exited"):
        llm.check_health()
    llm.shutdown()
