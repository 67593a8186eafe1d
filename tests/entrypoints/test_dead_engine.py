"""A server whose engine dies, in-process (through ASGI): the request the engine held gets a 500
error object of type InternalServerError whose message names the signal that killed the engine's
process, /health turns 503, and later requests get the same 500. As a real ``micro-vllm serve``
process, the server then exits with status 1: test_server.py, on its one-slot server."""

import asyncio

import httpx

from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.async_llm import AsyncLLM
from micro_vllm.entrypoints.openai.api_server import build_app
from micro_vllm.metrics.loggers import PrometheusStatLogger
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
