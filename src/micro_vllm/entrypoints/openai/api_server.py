"""The FastAPI app of ``micro-vllm serve``: OpenAI's routes, health, metrics, tokenization.

``build_app`` wires routes to an ``OpenAIServing``; ``run_server`` builds the ``AsyncLLM`` from the
command line's settings and runs the app under uvicorn. Every refusal is OpenAI's error object with
its status: 400 for a body that is not JSON or has a missing or wrong field (pydantic's check, before
any handler runs) and for what the engine refuses, 401 for a wrong API key (routes under /v1), 404 for
a model this server does not serve; none of them reaches the engine. A dead engine loop gives 500.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from micro_vllm.engine.async_llm import AsyncLLM, EngineDeadError
from micro_vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from micro_vllm.entrypoints.openai.serving import OpenAIError, OpenAIServing, error_response
from micro_vllm.metrics.loggers import PrometheusStatLogger


def build_app(engine: AsyncLLM, served_model_names: list[str], model_path: str,
              stat_logger: PrometheusStatLogger, api_key: str | None = None) -> FastAPI:
    serving = OpenAIServing(engine, served_model_names, model_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="micro-vLLM", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return _error_json(error.response(), error.status)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return _error_json(error_response(str(error), HTTPStatus.INTERNAL_SERVER_ERROR),
                           HTTPStatus.INTERNAL_SERVER_ERROR)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        field = ".".join(str(part) for part in first.get("loc", ())[1:]) or None  # loc starts with "body"
        message = "; ".join(f"{'.'.join(map(str, p['loc'][1:])) or 'body'}: {p['msg']}" for p in problems)
        return _error_json(error_response(message or "invalid request body", HTTPStatus.BAD_REQUEST, field),
                           HTTPStatus.BAD_REQUEST)

    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    # A dependency of the /v1 routes rather than an HTTP middleware: Starlette's middleware relays
    # every chunk of a streamed response through a queue of its own.
    async def check_api_key(request: Request) -> None:
        if expected is not None and not secrets.compare_digest(request.headers.get("Authorization", "").encode(),
                                                               expected):
            raise OpenAIError("Incorrect API key provided", HTTPStatus.UNAUTHORIZED)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE if engine.errored else HTTPStatus.OK)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        return serving.show_available_models()

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await _until_disconnected(serving.create_completion(request), raw_request)

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await _until_disconnected(serving.create_chat_completion(request), raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return serving.detokenize(request)

    app.include_router(v1)
    return app


async def _until_disconnected(handler: Coroutine, raw_request: Request):
    """Run a generation handler, cancelled (so its request aborted) if the client leaves before the
    response starts; a stream's own cancellation is Starlette's, once it runs."""
    work = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    done, _ = await asyncio.wait((work, listener), return_when=asyncio.FIRST_COMPLETED)
    if work not in done:
        work.cancel()
        return Response(status_code=499)  # nobody reads it: the client is gone
    listener.cancel()
    result = work.result()
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return result


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def _error_json(body, status: HTTPStatus) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=status)


def run_server(config, served_model_names: list[str], host: str, port: int, api_key: str | None,
               access_log: bool = True) -> None:
    """Load the model, then serve until interrupted."""
    import uvicorn

    stat_logger = PrometheusStatLogger(served_model_names[0])
    engine = AsyncLLM(config, stat_loggers=[stat_logger])
    app = build_app(engine, served_model_names, config.model_config.model, stat_logger, api_key)
    uvicorn.run(app, host=host, port=port, access_log=access_log, log_level="info")
