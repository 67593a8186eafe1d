"""``AsyncLLM`` (vLLM's name): the engine loop in a background thread, and an async generator per request.

The ``Engine`` is not thread-safe, so only the loop thread ever touches it. An asyncio caller hands
its requests and aborts to that thread through a queue; the thread validates and adds them, steps
the engine while anything is unfinished, and hands each step's outputs back to the callers' event
loops (``call_soon_threadsafe``). Why a thread and not a process: torch releases the GIL inside its
kernels and the GPU runs asynchronously, so the event loop stays responsive; one process keeps
the KV cache, the scheduler and the outputs in one place with nothing to serialize
(docs/architecture.md, section 6).

A bad request fails only its own caller, with the engine's error (a ValueError or TypeError that
names the field). A caller that stops listening (cancelled, or the generator closed) aborts its
request before the next step, which frees its KV blocks. If the loop itself dies, every caller
waiting on it gets an ``EngineDeadError``, and so does every later call and ``check_health``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field

from micro_vllm.config import LLMConfig
from micro_vllm.engine.engine import Engine, PromptType
from micro_vllm.engine.output import RequestOutput
from micro_vllm.metrics.stats import IterationStats, RequestStateStats, SchedulerStats
from micro_vllm.sampling.params import RequestOutputKind, SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an error in a step, or shutdown); no request can be served any more."""


class RequestOutputCollector:
    """One request's outputs on its caller's event loop, waiting to be taken (vLLM's name).

    A caller that falls behind the engine (a busy server, a slow client) finds the outputs of every
    step it missed folded into one: it is handed one item however many steps ran, so a loaded event
    loop does less work per token instead of falling further behind. An error replaces whatever is
    waiting."""

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._item, RequestOutput) and isinstance(item, RequestOutput):
            self._item.add(item)
        elif not isinstance(self._item, BaseException):
            self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self._item is None:
            await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item


@dataclass
class _RequestStream:
    """Where one request's outputs go: a collector on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    collector: RequestOutputCollector
    stats: RequestStateStats = field(default_factory=lambda: RequestStateStats(time.monotonic()))


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    stream: _RequestStream


@dataclass(frozen=True)
class _Abort:
    request_id: str


_SHUTDOWN = object()


class AsyncLLM:
    """Serve requests concurrently from asyncio: ``async for out in llm.generate(prompt, params, id)``.

    ``stat_loggers`` get ``record(scheduler_stats, iteration_stats)`` from the loop thread after
    every step, and a snapshot between steps whenever the engine falls idle or shuts down."""

    def __init__(self, config: LLMConfig, stat_loggers: Iterable = ()) -> None:
        self.engine = Engine(config)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        # The frontend's own copy: a Hugging Face fast tokenizer must not be used by two threads at once.
        self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        self.stat_loggers = list(stat_loggers)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _RequestStream] = {}  # the loop thread's only
        self._dead_lock = threading.Lock()  # orders "is it dead?" before a command is queued
        self._dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_engine_loop, name="micro-vllm-engine", daemon=True)
        self._thread.start()

    # -- the caller's side (any event loop) ----------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as its tokens are sampled, each with only what is new
        (``RequestOutputKind.DELTA``, whatever ``sampling_params`` asks), the last one finished. An
        output holds every step since the caller last took one (``RequestOutputCollector``).

        Raises the engine's ValueError / TypeError for a request it refuses, and EngineDeadError if
        the loop dies. Leaving early (break, cancellation) aborts the request."""
        if sampling_params.output_kind is not RequestOutputKind.DELTA:
            sampling_params = dataclasses.replace(sampling_params, output_kind=RequestOutputKind.DELTA)
        stream = _RequestStream(asyncio.get_running_loop(), RequestOutputCollector())
        self._send(_Add(request_id, prompt, sampling_params, stream))
        finished = False
        try:
            while not finished:
                item = await stream.collector.get()
                if isinstance(item, BaseException):
                    finished = True  # refused or dead: nothing left to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(_Abort(request_id), raise_if_dead=False)

    async def abort(self, request_id: str) -> None:
        """Abort a request before the next step: its caller's stream ends with an output whose
        finish_reason is "abort" (nothing happens if it already finished)."""
        self._send(_Abort(request_id), raise_if_dead=False)

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine loop has stopped."""
        if self._dead_error is not None:
            raise self._new_dead_error()

    def shutdown(self) -> None:
        """Stop the loop (callers still waiting get EngineDeadError) and release the engine."""
        if self._thread.is_alive():
            self._commands.put(_SHUTDOWN)
            self._thread.join()
        self.engine.shutdown()

    def _send(self, command, raise_if_dead: bool = True) -> None:
        with self._dead_lock:
            if self._dead_error is None:
                self._commands.put(command)
            elif raise_if_dead:
                raise self._new_dead_error()

    def _new_dead_error(self) -> EngineDeadError:
        error = EngineDeadError(f"the engine loop stopped: {self._dead_error!r}")
        error.__cause__ = self._dead_error
        return error

    # -- the loop thread -----------------------------------------------------------------------

    def _run_engine_loop(self) -> None:
        engine = self.engine
        try:
            while self._apply_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._publish(outputs, engine.last_step_stats)
                if not engine.has_unfinished_requests():
                    self._log(engine.scheduler.make_stats(), None)  # idle: queues and KV as they are left
            self._log(engine.scheduler.make_stats(), None)  # what shutdown leaves, whatever came with it
            self._die(EngineDeadError("the engine was shut down"))
        except BaseException as error:  # noqa: BLE001 - whatever stops the loop fails every caller
            self._die(error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply the queued adds and aborts, waiting for the first one when ``block``; False on shutdown."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not _SHUTDOWN:
            if isinstance(command, _Abort):
                self._abort(command.request_id)
            else:
                self._add(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _add(self, command: _Add) -> None:
        stream = command.stream
        if command.request_id in self._streams:
            _deliver_soon(stream.loop, [(stream.collector, ValueError(
                f"request_id={command.request_id!r} is already in use; give each running request its own id"))])
            return
        try:
            self.engine.add_request(self.engine.make_request(command.request_id, command.prompt, command.params))
        except (ValueError, TypeError) as error:
            _deliver_soon(stream.loop, [(stream.collector, error)])
            return
        self._streams[command.request_id] = stream

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already, or refused
        output = self.engine.abort_request(request_id)
        if output is not None:
            iteration = IterationStats()
            iteration.update_from_output(stream.stats, len(output.prompt_token_ids), 0, "abort", time.monotonic())
            self._log(None, iteration)
            _deliver_soon(stream.loop, [(stream.collector, output)])  # ends a caller still reading the stream

    def _publish(self, outputs: list[RequestOutput], scheduler_stats: SchedulerStats) -> None:
        """Hand a step's outputs to their callers, one wake-up per event loop, and log the step."""
        now = time.monotonic()
        iteration = IterationStats()
        deliveries = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            iteration.update_from_output(
                stream.stats, len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs),
                output.outputs[0].finish_reason if output.finished else None, now,
            )
            deliveries[stream.loop].append((stream.collector, output))
        for loop, items in deliveries.items():
            _deliver_soon(loop, items)
        self._log(scheduler_stats, iteration)

    def _log(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        for logger in self.stat_loggers:
            logger.record(scheduler_stats, iteration)

    def _die(self, error: BaseException) -> None:
        """Fail every waiting caller and every queued command; later calls fail at once."""
        with self._dead_lock:
            self._dead_error = error
        streams = list(self._streams.values())
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                streams.append(command.stream)
        for stream in streams:
            _deliver_soon(stream.loop, [(stream.collector, self._new_dead_error())])


def _deliver_soon(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestOutputCollector, object]]) -> None:
    def deliver() -> None:
        for collector, item in items:
            collector.put(item)

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is listening
