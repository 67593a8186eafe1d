"""The FastAPI app of ``micro-vllm serve``: OpenAI's routes, health, metrics, tokenization, and vLLM's
other routes (/load, /version, /tokenizer_info, SageMaker's /invocations).

``build_app`` wires routes to an ``OpenAIServing``; ``run_server`` builds the ``AsyncLLM`` (or, with
``--data-parallel-size``, a ``DataParallelAsyncLLM`` of replicas) from the command line's settings and
runs the app under uvicorn until it is interrupted or its engine (any replica) dies.

Every refusal is OpenAI's error object with its status and the field at fault (``param``): 400 for a
body that is not JSON (or not UTF-8, or nested past 200 levels), a missing or wrong field, a value
out of its range, and what the engine refuses; 401 for a wrong API key (routes under /v1 and
/invocations, checked before the body is read); 404 for a model this server does not serve or a
route it does not have; 405 for a wrong method; 413 for a body over ``max_request_body_bytes``. None
of them reaches the engine, and none is a 500: a 500 is the server's own failure.

When the engine dies (an error in a step, its process killed), the requests it held get a 500 whose
message says how, ``/health`` answers 503, and the server exits with status 1 within a second, as
vLLM's API server exits so that its supervisor (systemd, Kubernetes...) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

import micro_vllm

from micro_vllm.engine.async_llm import AsyncLLM, EngineDeadError
from micro_vllm.engine.data_parallel import DataParallelAsyncLLM, build_async_llm
from micro_vllm.entrypoints.openai.protocol import ErrorResponse, OpenAIError, error_response
from micro_vllm.entrypoints.openai.serving import OpenAIServing
from micro_vllm.entrypoints.openai.tool_parsers import ToolParserManager
from micro_vllm.metrics.loggers import PrometheusStatLogger
from micro_vllm.utils import heap_frozen
from micro_vllm.validation import check_int, check_optional_int

logger = logging.getLogger(__name__)

# The largest request body, by default: ten megabytes of prompt or chat message with room to spare
# (a 131,072-token prompt is about a megabyte of text or of token ids).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20

# How often the server checks that its engine still runs (vLLM's watchdog checks every 5 s).
WATCHDOG_INTERVAL_S = 1.0

# The routes whose requests /load counts.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


def build_app(engine: AsyncLLM | DataParallelAsyncLLM, served_model_names: list[str], model_path: str,
              stat_logger: PrometheusStatLogger, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, enable_log_requests: bool = False,
              max_log_len: int | None = None, tool_parser: str | None = None) -> FastAPI:
    serving = OpenAIServing(engine, served_model_names, model_path, enable_log_requests, max_log_len, tool_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # While it serves, the objects of its start-up (torch's and transformers' modules, the
        # tokenizer, the app) stay out of the collector's scans: the requests' objects set off full
        # collections, and a scan of them all would stall every stream (vLLM's API server freezes its
        # heap too).
        gc.collect()
        with heap_frozen():
            yield
        serving.shutdown()
        engine.shutdown()

    app = FastAPI(title="micro-vLLM", lifespan=lifespan)
    load = ServerLoad()
    app.add_middleware(_LoadTracker, load=load)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return _error_json(error.response())

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return _error_json(error_response(str(error), HTTPStatus.INTERNAL_SERVER_ERROR))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route: 404, a wrong method: 405) in OpenAI's shape."""
        message = f"{error.detail}: {request.method} {request.url.path}"
        return _error_json(error_response(message, HTTPStatus(error.status_code)), error.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left while sending its body: nobody reads this

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        """A failure of the server itself (never of a request's input), also logged with its traceback."""
        return _error_json(error_response(f"{type(error).__name__}: {error}", HTTPStatus.INTERNAL_SERVER_ERROR))

    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    # A dependency of the /v1 routes rather than an HTTP middleware: Starlette's middleware relays
    # every chunk of a streamed response through a queue of its own.
    async def check_api_key(request: Request) -> None:
        if expected is not None and not secrets.compare_digest(request.headers.get("Authorization", "").encode(),
                                                               expected):
            raise OpenAIError("Incorrect API key provided", HTTPStatus.UNAUTHORIZED)

    async def body(request: Request) -> bytes:
        return await _read_body(request, max_request_body_bytes)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE if engine.errored else HTTPStatus.OK)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def server_load():
        return {"server_load": load.count}

    @app.get("/version")
    async def version():
        return {"version": micro_vllm.__version__}

    @v1.get("/models")
    async def models():
        return serving.show_available_models()

    @v1.post("/completions")
    async def completions(raw_request: Request):
        return await _until_disconnected(serving.create_completion(await body(raw_request)), raw_request)

    @v1.post("/chat/completions")
    async def chat_completions(raw_request: Request):
        return await _until_disconnected(serving.create_chat_completion(await body(raw_request)), raw_request)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request):
        return _json(await serving.tokenize(await body(raw_request)))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request):
        return _json(await serving.detokenize(await body(raw_request)))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return _json(serving.tokenizer_info())

    # SageMaker's route, outside /v1 as in vLLM, but behind the API key like the routes it stands for.
    @app.post("/invocations", dependencies=[Depends(check_api_key)])
    async def invocations(raw_request: Request):
        return await _until_disconnected(serving.create_invocation(await body(raw_request)), raw_request)

    app.include_router(v1)
    return app


@dataclass
class ServerLoad:
    """vLLM's /load figure: the generation requests the server holds, from their arrival to the end of
    their response (its last chunk sent, or its client gone)."""

    count: int = 0


class _LoadTracker:
    """Counts the requests to the generation routes in a ``ServerLoad``: a plain ASGI middleware, through
    which a stream's chunks pass untouched."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to pass ``limit`` bytes: at once when
    its Content-Length says so, else (a chunked body) when the bytes received pass it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(f"the request body has {'more than ' if size <= limit else ''}{size} bytes; this server takes "
                       f"at most {limit} (--max-request-body-bytes)", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


async def _until_disconnected(handler: Coroutine, raw_request: Request) -> Response:
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
    return _json(result)


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def _json(content: str) -> Response:
    """A response of JSON made on the serving's thread pool (a large one, such as /tokenize's for a
    long prompt, would take the event loop a while)."""
    return Response(content, media_type="application/json")


def _error_json(body: ErrorResponse, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=body.error.code, headers=headers)


def run_server(config, served_model_names: list[str], host: str, port: int, api_key: str | None,
               access_log: bool = True, max_request_body_bytes: int | None = None,
               enable_log_requests: bool = False, max_log_len: int | None = None,
               tool_parser: str | None = None) -> int:
    """Load the model, then serve until interrupted (returns 0) or until the engine dies (returns 1).
    ``max_request_body_bytes`` None is ``DEFAULT_MAX_REQUEST_BODY_BYTES``; ``tool_parser`` is the
    parser for ``tool_choice="auto"`` (None: "auto" is refused)."""
    if max_request_body_bytes is None:
        max_request_body_bytes = DEFAULT_MAX_REQUEST_BODY_BYTES
    check_int("max_request_body_bytes", max_request_body_bytes, 1, None)  # before the model loads
    check_optional_int("max_log_len", max_log_len, 0, None)
    if tool_parser is not None:
        ToolParserManager.get_tool_parser(tool_parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    stat_logger = PrometheusStatLogger(served_model_names[0], config.cache_config,
                                       range(config.parallel_config.data_parallel_size))
    engine = build_async_llm(config, stat_loggers=[stat_logger])
    app = build_app(engine, served_model_names, config.model_config.model, stat_logger, api_key,
                    max_request_body_bytes, enable_log_requests, max_log_len, tool_parser)
    server = _Server(uvicorn.Config(app, host=host, port=port, access_log=access_log, log_level="info"), engine)
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C during the graceful shutdown, as uvicorn.run allows
        pass
    return 1 if engine.errored else 0


class _Server(uvicorn.Server):
    """uvicorn's server, shut down once its engine has died (vLLM's watchdog): the requests the engine
    held have had their 500s, and a fresh server is the supervisor's to start."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM | DataParallelAsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine

    async def serve(self, sockets=None) -> None:
        watching = asyncio.create_task(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watching.cancel()

    async def _watch_engine(self) -> None:
        while not self.engine.errored:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        try:
            self.engine.check_health()
        except EngineDeadError as error:
            logger.error("%s; shutting the server down so that a supervisor can start a fresh one", error)
        self.should_exit = True
