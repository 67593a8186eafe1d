"""The multiprocess executor: one worker process per rank, on CPU.

With one rank in a process of its own the engine gives exactly the in-process executor's tokens (the
fault tests' workload: chunked prefill, prefix hits, preemption, sliding windows, seeded sampling,
stop strings), and a failed step's rollback reaches the worker. A worker killed mid-run fails the
engine with EngineDeadError and leaves no process; a rank that cannot start fails the start on every
rank with its own error; a worker never outlives its parent. (Several ranks of one model need the
model's parallel layers, which are tested in test_parallel_layers.py.)

The tests that share ``mp_llm`` run in file order: the last of them kills its worker.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from helpers.core_helpers import check_all_free, token_ids
from helpers.distributed import process_running
from helpers.failing_rank import LlamaConfigFailingOnRank1
from helpers.fault_workload import (  # noqa: F401
    PARAMS,
    PROMPTS,
    expected,
    make_llm,
    model_dir,
    record_preemptions,
    roll_back_a_run,
)
from helpers.tiny_models import make_tiny_model
from micro_vllm.engine.arg_utils import EngineArgs
from micro_vllm.engine.exceptions import EngineDeadError
from micro_vllm.executor.multiproc_executor import MultiprocExecutor, RemoteTraceback

# Generous: how long a process may take to go, only so that a failure does not hang the suite.
GONE_WITHIN_S = 60


@pytest.fixture(scope="module")
def mp_llm(model_dir):
    llm = make_llm(model_dir, distributed_executor_backend="mp")
    yield llm
    llm.shutdown()


def test_one_rank_in_its_own_process_gives_the_in_process_tokens(mp_llm, expected):
    assert isinstance(mp_llm.engine.executor, MultiprocExecutor)
    preempted = record_preemptions(mp_llm)
    assert token_ids(mp_llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    assert preempted


def test_a_rollback_reaches_the_worker(mp_llm, expected):
    roll_back_a_run(mp_llm)
    assert token_ids(mp_llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


def test_a_killed_worker_fails_the_engine_and_leaves_no_process(mp_llm):
    engine = mp_llm.engine
    [worker] = engine.executor.workers
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"request-{index}", prompt, PARAMS[index])
    engine.step()
    os.kill(worker.process.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    check_all_free(engine.scheduler)  # the failed step's requests were aborted, their blocks freed
    with pytest.raises(EngineDeadError):
        mp_llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    assert not worker.process.is_alive()


def test_a_rank_that_cannot_start_fails_the_start_on_every_rank(model_dir):
    path = make_tiny_model("llama", model_dir.parent, name="llama-for-failure")
    hf_config = LlamaConfigFailingOnRank1.from_pretrained(path)
    config = EngineArgs(model=str(path), device="cpu", tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="injected: rank 1 cannot build its model") as failure:
        MultiprocExecutor(config, path, hf_config, max_model_len=64)
    assert isinstance(failure.value.__cause__, RemoteTraceback)  # where it was raised, in the worker
    assert "in worker process" in str(failure.value.__cause__)
    # Rank 0 had started (and waited for commands): it was stopped too.
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("micro-vllm-worker")]


PARENT = """
import sys, time
from micro_vllm import LLM
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], device="cpu", max_model_len=64, block_size=8, distributed_executor_backend="mp")
    print(llm.engine.executor.workers[0].process.pid, flush=True)
    time.sleep(600)
"""


def test_a_worker_never_outlives_its_parent(model_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
    finally:
        parent.kill()  # SIGKILL: the parent gets no chance to stop its worker
        parent.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while process_running(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_running(worker_pid)


def test_a_worker_process_freezes_its_heap_once_started():
    """A rank's process is the engine's for good: once its KV cache is set up (start-up's last call:
    the warm-up and the CUDA graphs are in it), what start-up made leaves the collector's scans."""
    from micro_vllm.executor.multiproc_executor import WorkerProc

    calls = []
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_attention_specs=None), determine_num_blocks=None,
                             initialize_kv_cache=lambda *args: calls.append(args))
    proc = WorkerProc(worker, 0, results=None)
    before = gc.get_freeze_count()
    try:
        proc.calls["initialize_kv_cache"]([], 8)
        assert calls == [([], 8)] and gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
