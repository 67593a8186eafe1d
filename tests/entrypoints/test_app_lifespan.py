"""The app's lifespan: while it serves, the objects of its start-up are out of the garbage collector's
scans (a full collection over them would stall every stream); at shutdown they are put back and the
engine is shut down."""

from __future__ import annotations

import asyncio
import gc

from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.async_llm import AsyncLLM
from micro_vllm.entrypoints.openai.api_server import build_app
from micro_vllm.metrics.loggers import PrometheusStatLogger
from helpers.tiny_models import make_tiny_model, one_torch_thread  # noqa: F401


def test_the_heap_is_frozen_while_the_app_serves(tmp_path):
    engine_args = AsyncEngineArgs(model=str(make_tiny_model("llama", tmp_path)), device="cpu", max_model_len=64)
    logger = PrometheusStatLogger("tiny", engine_args.create_engine_config().cache_config)
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[logger])
    app = build_app(engine, ["tiny"], "tiny", logger)
    before = gc.get_freeze_count()

    async def serve() -> int:
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count()

    try:
        serving = asyncio.run(serve())
        shut_down = engine.errored  # by the lifespan's end
    finally:
        engine.shutdown()
    assert serving > before and gc.get_freeze_count() == before
    assert shut_down
