"""Data-parallel replicas behind one server (``--data-parallel-size``, ``engine/data_parallel.py``), on CPU.

A real ``micro-vllm serve -dp 2``, driven with the official ``openai`` client: 64 concurrent requests
(greedy and seeded sampling) give what one engine gives offline, both replicas finish some (the
``engine`` label of /metrics), and a replica killed then takes the server down with no process left.
In-process (through ASGI): a replica killed mid-request fails its own request with the engine's 500,
the other replica's request finishes, /health answers 503 and later requests go to the replica still
running. Bad values are refused naming the field."""

import asyncio
import os
import signal

import httpx
import openai
import pytest
import torch

from micro_vllm import LLM, SamplingParams
from micro_vllm.cli import main
from micro_vllm.config import LLMConfig, ModelConfig, ParallelConfig
from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.data_parallel import DataParallelAsyncLLM, _Replica
from micro_vllm.entrypoints.openai.api_server import build_app
from micro_vllm.metrics.loggers import PrometheusStatLogger
from micro_vllm.metrics.stats import SchedulerStats
from helpers.server import metric, serve_process, spawned_by
from helpers.tiny_models import make_tiny_model, one_torch_thread  # noqa: F401

SETTINGS = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, block_size=8)
NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("dp"))


def request(index: int) -> tuple[list[int], dict]:
    """The index-th request: a prompt of token ids, greedy for even indexes, else sampled with a seed."""
    prompt = [(7 * index + position) % 90 + 5 for position in range(3 + index % 5)]
    sampling = dict(temperature=0) if index % 2 == 0 else dict(temperature=1.0, top_p=0.9, seed=index)
    return prompt, dict(max_tokens=6, **sampling)


def test_two_replicas_serve_concurrent_requests_as_one_engine(model_dir):
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    with serve_process(str(model_dir), "-dp", "2", "--served-model-name", "tiny", *flags) as server:
        replicas = spawned_by(server.process.pid)
        assert len(replicas) == 2  # an engine process per replica

        async def main():
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            completions = [client.completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True},
                                                     **fields)
                           for prompt, fields in map(request, range(NUM_REQUESTS))]
            return [completion.choices[0].text for completion in await asyncio.gather(*completions)]

        texts = asyncio.run(main())
        metrics = httpx.get(f"{server.url}/metrics").text
        finished = [metric(metrics, "vllm:request_success_total", engine=str(replica), finished_reason="length")
                    for replica in range(2)]
        assert all(count > 0 for count in finished) and sum(finished) == NUM_REQUESTS

        os.kill(replicas[1], signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1  # its supervisor's to restart, as with one engine
        assert not any(os.path.exists(f"/proc/{pid}") for pid in replicas)
        assert "the engine process was killed by SIGKILL; shutting the server down" in server.output()

    with LLM(model=str(model_dir), device="cpu", **SETTINGS) as llm:
        requests = [request(index) for index in range(NUM_REQUESTS)]
        expected = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in requests],
                                [SamplingParams(ignore_eos=True, **fields) for _, fields in requests], use_tqdm=False)
    assert texts == [output.outputs[0].text for output in expected]


def test_the_load_is_waiting_times_four_plus_running():
    replica = _Replica(0, [])
    replica.in_flight = 5  # sent and not finished
    replica.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=0, kv_total_blocks=8, kv_free_blocks=8,
                                  kv_cached_blocks=0), None)
    assert replica.load == 3 * 4 + 2
    replica.in_flight = 1  # finished since the report, which still counts them running
    assert replica.load == 1


BODY = {"prompt": [1, 2, 3], "max_tokens": 24, "ignore_eos": True}


def test_a_dead_replica_fails_its_requests_and_health(model_dir):
    engine_args = AsyncEngineArgs(model=str(model_dir), device="cpu", data_parallel_size=2, **SETTINGS)
    logger = PrometheusStatLogger("tiny", engine_args.create_engine_config().cache_config, range(2))
    engine = DataParallelAsyncLLM.from_engine_args(engine_args, stat_loggers=[logger])
    processes = [replica.engine._process for replica in engine._replicas]

    class KillReplicaOnFirstTokens:  # replica 1 dies once its first output is out: inside the response
        def record(self, scheduler_stats, iteration_stats, engine_idx):
            if engine_idx == 1 and iteration_stats is not None and iteration_stats.num_generation_tokens:
                processes[1].kill()

    engine.stat_loggers.append(KillReplicaOnFirstTokens())
    app = build_app(engine, ["tiny"], "tiny", logger)

    async def main():
        # Both replicas idle: the first request goes to replica 0, and stays in flight there until its
        # generator ends, so the next one goes to replica 1.
        held = engine.generate({"prompt_token_ids": BODY["prompt"]},
                               SamplingParams(max_tokens=BODY["max_tokens"], ignore_eos=True), "held")
        outputs = [await anext(held)]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            failed = await http.post("/v1/completions", json=BODY)
            health = await http.get("/health")
            later = await http.post("/v1/completions", json=BODY)
        outputs += [output async for output in held]
        return outputs, failed, health, later

    try:
        outputs, failed, health, later = asyncio.run(main())
    finally:
        engine.shutdown()
    assert failed.status_code == 500
    assert failed.json()["error"] == {"message": "the engine process was killed by SIGKILL",
                                      "type": "InternalServerError", "param": None, "code": 500}
    assert health.status_code == 503
    assert sum(len(output.outputs[0].token_ids) for output in outputs) == BODY["max_tokens"]
    assert outputs[-1].finished and later.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert [process.exitcode for process in processes] == [0, -signal.SIGKILL]  # none left running


def test_bad_data_parallel_settings_are_refused(model_dir, capsys, monkeypatch):
    assert main(["serve", str(model_dir), "-dp", "-1", "--device", "cpu"]) == 2
    assert "data_parallel_size=-1 is not allowed" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"data_parallel_size=2 is not allowed; it must be 1 for LLM.*"
                                         r"micro-vllm serve --data-parallel-size 2"):
        LLM(model=str(model_dir), device="cpu", data_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    config = LLMConfig(ModelConfig(model=str(model_dir), device="cuda"),
                       parallel_config=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2))
    with pytest.raises(ValueError, match=r"data_parallel_size=2 with tensor_parallel_size=2 needs 4 CUDA devices "
                                         r"\(one per rank of each replica\); this machine has 3"):
        DataParallelAsyncLLM(config)
