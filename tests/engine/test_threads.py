"""One LLM, several threads: generate calls run one after another, aborts from any thread work,
shutdown from another thread ends a running generate with a clear error, and LLM() leaves torch's
global RNG alone."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from helpers.core_helpers import check_all_free
from micro_vllm import SamplingParams
from helpers.fault_workload import PARAMS, PROMPTS, expected, make_llm, model_dir  # noqa: F401  (fixtures)
from helpers.tiny_models import one_torch_thread  # noqa: F401  (an autouse fixture)

# Seconds of random calls from two threads; raise it locally for a longer soak.
SOAK_SECONDS = 10.0


def test_two_threads_share_one_llm(model_dir, expected):  # noqa: F811
    """Random calls (prompt i always with PARAMS[i]) and aborts from three threads: no call hangs,
    and every request gives the tokens it gets in a fresh engine (an aborted one, a prefix of them)."""
    llm = make_llm(model_dir)
    deadline = time.monotonic() + SOAK_SECONDS
    errors: list[str] = []
    counts = {"calls": 0, "aborted": 0, "requests": 0}  # requests: about the next request id

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < deadline:
                chosen = [rng.randrange(len(PROMPTS)) for _ in range(rng.randint(1, 4))]
                counts["requests"] += len(chosen)
                outputs = llm.generate([PROMPTS[i] for i in chosen], [PARAMS[i] for i in chosen], use_tqdm=False)
                counts["calls"] += 1
                for i, output in zip(chosen, outputs):
                    want = expected[i]
                    if output.outputs[0].finish_reason == "abort":
                        counts["aborted"] += 1
                        want = want[: len(output.outputs[0].token_ids)]
                    if output.outputs[0].token_ids != want:
                        errors.append(f"prompt {i}: {output.outputs[0].token_ids} != {want}")
        except BaseException as error:  # noqa: BLE001  (reported to the main thread)
            errors.append(repr(error))

    def aborter() -> None:
        rng = random.Random(2)
        while time.monotonic() < deadline:
            # Mostly ids of calls running or queued now, some already finished.
            llm.abort_request(str(max(0, counts["requests"] - rng.randrange(8))))
            time.sleep(rng.uniform(0, 0.1))

    threads = [threading.Thread(target=caller, args=(seed,), daemon=True) for seed in (0, 1)]
    threads.append(threading.Thread(target=aborter, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SOAK_SECONDS + 120)
        assert not thread.is_alive(), "a thread hangs"
    assert not errors, errors[:5]
    assert counts["calls"] >= 4 and counts["aborted"] > 0
    check_all_free(llm.engine.scheduler)


def test_shutdown_from_another_thread_ends_generate(model_dir):  # noqa: F811
    llm = make_llm(model_dir, num_blocks=64)
    engine = llm.engine
    stepped = threading.Event()
    step = engine.step

    def signalling_step():
        stepped.set()
        return step()

    engine.step = signalling_step
    raised: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate(PROMPTS * 4, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
        except BaseException as error:  # noqa: BLE001
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert stepped.wait(60), raised
    llm.shutdown()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError) and "shutdown" in str(raised[0])
    check_all_free(engine.scheduler)  # the call's requests were aborted before the engine went
    assert llm.engine is None and engine.executor.worker is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, use_tqdm=False)


def test_llm_leaves_the_global_rng_alone(model_dir):  # noqa: F811
    state = torch.get_rng_state()
    llm = make_llm(model_dir, seed=1234)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=1.0), use_tqdm=False)  # unseeded draws
    assert torch.equal(torch.get_rng_state(), state)


def test_calls_from_a_callback_inside_generate(model_dir):  # noqa: F811
    """A callback that runs inside generate (here, around a step) cannot start another generate,
    and its shutdown takes effect when the running call ends, with the same error."""
    llm = make_llm(model_dir)
    engine = llm.engine
    step = engine.step
    nested: list[BaseException] = []

    def step_with_callback():
        try:
            llm.generate(PROMPTS, use_tqdm=False)
        except RuntimeError as error:
            nested.append(error)
        assert llm.reset_prefix_cache() is False
        llm.shutdown()
        return step()

    engine.step = step_with_callback
    with pytest.raises(RuntimeError, match="shutdown"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(nested) == 1 and "inside generate" in str(nested[0])
    check_all_free(engine.scheduler)
    assert llm.engine is None
