"""The Ray executor: one Ray actor per rank, on a local Ray instance of 2 CPUs (gloo).

Two ranks on Ray actors give exactly the tokens of one rank in process (the fault tests' workload:
chunked prefill, prefix hits, preemption, sliding windows, seeded sampling, stop strings), as two ranks
in processes of their own do (test_tensor_parallel_engine.py), and a failed step's rollback reaches
every actor. An actor killed mid-run fails the requests with EngineDeadError and leaves no actor
process, no placement group and no reserved CPU behind; so does a rank that cannot start (its error
reaching the caller), and so does shutdown. A cluster without the GPUs the ranks need refuses at
once. Without Ray installed, the flag is refused with the way to install it.

Starting Ray and each executor's actors is what costs: one Ray instance for the module, one engine
shared by the tests that use ``ray_llm`` (in file order: the last of them kills an actor).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from helpers.core_helpers import check_all_free, token_ids  # noqa: E402
from helpers.distributed import process_running  # noqa: E402
from helpers.failing_rank import LlamaConfigFailingOnRank1  # noqa: E402
from helpers.fault_workload import (  # noqa: E402,F401
    PARAMS,
    PROMPTS,
    expected,
    make_llm,
    model_dir,
    record_preemptions,
    roll_back_a_run,
)
from helpers.tiny_models import make_tiny_model  # noqa: E402
from micro_vllm.engine.arg_utils import EngineArgs  # noqa: E402
from micro_vllm.engine.exceptions import EngineDeadError  # noqa: E402
from micro_vllm.executor import ray_distributed_executor  # noqa: E402
from micro_vllm.executor.ray_distributed_executor import RayDistributedExecutor  # noqa: E402

NUM_CPUS = 2
start_actors = ray_distributed_executor._start_actors
# Generous: how long Ray may take to end a process or return resources, only so that a failure does
# not hang the suite.
GONE_WITHIN_S = 60


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance of two CPUs; its actors import the tests' helpers (a failing config)."""
    tests_dir = str(Path(__file__).parents[1])
    with pytest.MonkeyPatch.context() as patch:  # the instance's processes inherit this environment
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
        # "local": a new instance, even where `ray start` runs a cluster on this machine.
        ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_llm(ray_cluster, model_dir):
    llm = make_llm(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    yield llm
    llm.shutdown()


def test_two_ranks_on_ray_give_the_tokens_of_one_rank(ray_llm, expected):
    assert isinstance(ray_llm.engine.executor, RayDistributedExecutor)
    preempted = record_preemptions(ray_llm)
    assert token_ids(ray_llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    assert preempted


def test_a_rollback_reaches_every_actor(ray_llm, expected):
    roll_back_a_run(ray_llm)
    assert token_ids(ray_llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


def test_a_killed_actor_fails_the_requests_and_leaves_nothing(ray_llm):
    engine = ray_llm.engine
    workers = list(engine.executor.workers)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"request-{index}", prompt, PARAMS[index])
    engine.step()
    ray.kill(workers[1].actor)
    with pytest.raises(EngineDeadError, match="ActorDiedError|RayActorError") as failure:
        while engine.has_unfinished_requests():
            engine.step()
    assert isinstance(failure.value.__cause__, ray.exceptions.RayActorError)
    check_all_free(engine.scheduler)  # the failed step's requests were aborted, their blocks freed
    with pytest.raises(EngineDeadError):
        ray_llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    check_nothing_left(workers)


def test_a_rank_that_cannot_start_fails_the_start_and_leaves_nothing(ray_cluster, model_dir):
    path = make_tiny_model("llama", model_dir.parent, name="llama-for-failure")
    hf_config = LlamaConfigFailingOnRank1.from_pretrained(path)
    config = EngineArgs(model=str(path), device="cpu", tensor_parallel_size=2,
                        distributed_executor_backend="ray").create_engine_config()
    started = []

    def record_actors(*args):  # the executor's actors, to check that they are gone
        started.extend(start_actors(*args))
        return started

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray_distributed_executor, "_start_actors", record_actors)
        with pytest.raises(ValueError, match="injected: rank 1 cannot build its model"):
            RayDistributedExecutor(config, path, hf_config, max_model_len=64)
    assert len(started) == 2
    check_nothing_left(started)


def test_a_cluster_without_the_devices_refuses_at_once(ray_cluster, model_dir):
    config = EngineArgs(model=str(model_dir), device="cuda", tensor_parallel_size=2,
                        distributed_executor_backend="ray").create_engine_config()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPU in the Ray cluster, one per rank; "
                                         r"its 1 node\(s\) have 0"):
        RayDistributedExecutor(config, model_dir, None, max_model_len=64)
    check_nothing_left([])


def test_shutdown_leaves_nothing(ray_cluster, model_dir, expected):
    llm = make_llm(model_dir, distributed_executor_backend="ray")  # one rank: one actor to start
    workers = list(llm.engine.executor.workers)
    assert token_ids(llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)) == expected[:1]
    llm.shutdown()
    check_nothing_left(workers)
    assert ray.is_initialized()  # the instance it joined is not its own to stop


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed: importing it fails
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray' needs Ray.*pip install -e '\.\[ray\]'"):
        EngineArgs(model="m", tensor_parallel_size=2, distributed_executor_backend="ray").create_engine_config()


def check_nothing_left(workers) -> None:
    """No process of ``workers``' actors runs, no placement group is left, every CPU is free again
    (Ray ends them shortly after the executor asks)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        running = [w.place.pid for w in workers if process_running(w.place.pid)]
        groups = [g["state"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        free_cpus = ray.available_resources().get("CPU")
        if (not running and not groups and free_cpus == NUM_CPUS) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (running, groups, free_cpus) == ([], [], NUM_CPUS)


def test_a_ray_worker_freezes_its_heap_once_started():
    """An actor's process is its rank's for good: once the KV cache is set up (start-up's last call),
    what start-up made leaves the collector's scans."""
    from micro_vllm.executor.ray_distributed_executor import RayWorkerWrapper

    calls = []
    wrapper = RayWorkerWrapper()
    wrapper.worker = SimpleNamespace(initialize_kv_cache=lambda *args: calls.append(args))
    before = gc.get_freeze_count()
    try:
        wrapper.initialize_kv_cache([], 8)
        assert calls == [([], 8)] and gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
