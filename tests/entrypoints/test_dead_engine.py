"""A server whose engine dies. In-process (through ASGI): the request the engine held gets a 500 error
object of type InternalServerError whose message names the signal that killed the engine's process,
/health turns 503, and later requests get the same 500. As a real ``micro-vllm serve`` process: a
stream in flight ends with that error, and the server then exits with status 1, saying why in its
log, as vLLM's API server exits so that a supervisor starts a fresh one."""

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx

from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.async_llm import AsyncLLM
from micro_vllm.entrypoints.openai.api_server import build_app
from micro_vllm.metrics.loggers import PrometheusStatLogger
from helpers.server import serve_process
from helpers.tiny_models import make_tiny_model, one_torch_thread  # noqa: F401

BODY = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True}


def test_a_dead_engine_fails_requests_and_health(tmp_path):
    engine_args = AsyncEngineArgs(model=str(make_tiny_model("llama", tmp_path)), device="cpu", max_model_len=64)
    logger = PrometheusStatLogger("tiny", engine_args.create_engine_config().cache_config)
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[logger])

    killed = []

    class KillOnFirstTokens:  # the engine dies once the first output is out: inside the response
        def record(self, scheduler_stats, iteration_stats):
            if iteration_stats is not None and iteration_stats.num_generation_tokens and not killed:
                killed.append(1)
                engine._process.kill()

    engine.stat_loggers.append(KillOnFirstTokens())
    app = build_app(engine, ["tiny"], "tiny", logger)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            failed = await http.post("/v1/completions", json=BODY)
            health = await http.get("/health")
            later = await http.post("/v1/completions", json={**BODY, "stream": True})
            return failed, health, later

    try:
        failed, health, later = asyncio.run(main())
    finally:
        engine.shutdown()
    assert killed
    for response in (failed, later):
        assert response.status_code == 500
        assert response.json()["error"] == {"message": "the engine process was killed by SIGKILL",
                                             "type": "InternalServerError", "param": None, "code": 500}
    assert health.status_code == 503


def test_the_server_exits_when_its_engine_dies(tmp_path):
    with serve_process(str(make_tiny_model("llama", tmp_path)), "--max-model-len", "64") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
                events = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data:"))
                assert "choices" in json.loads(next(events))
                os.kill(_engine_pid(server.process.pid), signal.SIGKILL)
                last = [event for event in events][-2:]
        assert last[1] == "[DONE]"
        assert json.loads(last[0])["error"]["message"] == "the engine process was killed by SIGKILL"
        assert server.process.wait(timeout=60) == 1
        log = server.output()
        assert "the engine process was killed by SIGKILL; shutting the server down" in log


def _engine_pid(server_pid: int) -> int:
    """The engine's process: the server's child that multiprocessing spawned."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    [pid] = [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    return pid
