"""``AsyncLLM`` (vLLM's name): the engine in its own process, and an async generator per request.

The engine runs in a background process (``core_proc.py``), as vLLM's engine core does. In one
process the HTTP server's event loop and the engine's host work (planning, input preparation,
detokenization) would share one GIL, and with a few hundred streams the server's work per token
slowed every engine step (docs/architecture.md, section 6). Requests and aborts go to the process
over a pipe; each step's outputs come back as one message, which a reader thread hands to the
callers' event loops, one wake-up per loop per step.

A bad request fails only its own caller, with the engine's error (a ValueError or TypeError that
names the field). A caller that stops listening (cancelled, or the generator closed) aborts its
request before the next step, which frees its KV blocks. If the engine stops (an error in a step, or
its process exits), every caller waiting on it gets an ``EngineDeadError``, and so does every later
call and ``check_health``.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import multiprocessing
import signal
import threading
from collections import defaultdict
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from micro_vllm.config import LLMConfig
from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.core_proc import run_engine_core
from micro_vllm.engine.engine import PromptType
from micro_vllm.engine.exceptions import EngineDeadError
from micro_vllm.engine.request_output import RequestOutput
from micro_vllm.metrics.stats import IterationStats, SchedulerStats
from micro_vllm.model_loader.checkpoint import resolve_model_path
from micro_vllm.sampling.params import RequestOutputKind, SamplingParams
from micro_vllm.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from micro_vllm.engine.data_parallel import DataParallelAsyncLLM

__all__ = ["AsyncLLM", "EngineDeadError", "RequestOutputCollector"]

SHUTDOWN_TIMEOUT_S = 60  # how long shutdown waits for the engine's process to end before killing it


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
    """Where one request's outputs go: a collector on its caller's event loop. The prompt comes with
    the request's first output only (``core_proc.py``); the stream keeps it for the others."""

    loop: asyncio.AbstractEventLoop
    collector: RequestOutputCollector
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None


class AsyncLLM:
    """Serve requests concurrently from asyncio: ``async for out in llm.generate(prompt, params, id)``.

    Building it starts the engine's process and waits until the model is loaded (an engine that
    cannot be built raises its error here). ``stat_loggers`` get ``record(scheduler_stats,
    iteration_stats)`` from the reader thread after every step (both made by the engine's process),
    and a snapshot whenever the engine falls idle or shuts down. It runs one engine: with
    ``data_parallel_size`` above 1, replica ``data_parallel_rank`` (``DataParallelAsyncLLM`` runs them all)."""

    def __init__(self, config: LLMConfig, stat_loggers: Iterable = ()) -> None:
        context = multiprocessing.get_context("spawn")  # a forked child would inherit this process' threads and CUDA state
        self._conn, child_conn = context.Pipe()
        # Not daemonic: a daemonic process may not start processes, and the engine's starts one per
        # tensor-parallel rank. It still never outlives this one: it stops when its pipe closes, and it
        # is terminated at this interpreter's exit unless shut down before, as a daemonic one would be
        # (this handler runs before multiprocessing's, which waits for every child that is not daemonic).
        self._process = context.Process(target=run_engine_core, args=(config, child_conn),
                                        name="micro-vllm-engine-core")
        self._process.start()
        atexit.register(self._process.terminate)
        child_conn.close()
        try:
            message = self._conn.recv()
        except EOFError:
            message = ("dead", EngineDeadError(f"the engine process {_exit_status(self._process)} while starting"))
        except BaseException:  # a Ctrl-C while the model loads, say: the process must not outlive this call
            self._stop_process(0)
            raise
        if message[0] == "dead":
            self._stop_process(SHUTDOWN_TIMEOUT_S)  # it ends by itself
            raise message[1]
        _, self.max_model_len, self.vocab_size = message
        model_config = config.model_config
        self.tokenizer = load_tokenizer(resolve_model_path(model_config.model), model_config.tokenizer)
        self.stat_loggers = list(stat_loggers)
        self._streams: dict[str, _RequestStream] = {}
        self._lock = threading.Lock()  # guards the streams and the dead error
        # The pipe's sending end has its own lock: a send can wait while the engine steps, and the
        # reader thread must still be able to take the streams' lock meanwhile.
        self._send_lock = threading.Lock()
        self._dead_error: BaseException | None = None
        self._reader = threading.Thread(target=self._read_outputs, name="micro-vllm-outputs", daemon=True)
        self._reader.start()

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs,
                         stat_loggers: Iterable = ()) -> AsyncLLM | DataParallelAsyncLLM:
        """vLLM's way to build it: from flat settings (``AsyncEngineArgs``); with ``data_parallel_size``
        above 1, a ``DataParallelAsyncLLM`` of that many replicas."""
        from micro_vllm.engine.data_parallel import build_async_llm  # it builds on this module

        return build_async_llm(engine_args.create_engine_config(), stat_loggers)

    # -- the caller's side (any event loop) ----------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as its tokens are sampled, each with only what is new
        (``RequestOutputKind.DELTA``, whatever ``sampling_params`` asks), the last one finished. An
        output holds every step since the caller last took one (``RequestOutputCollector``).

        Raises the engine's ValueError / TypeError for a request it refuses, EngineDeadError if the
        engine stops, and whatever keeps the request from reaching the engine (then it is forgotten:
        its id is free again). Leaving early (break, cancellation) aborts the request."""
        if sampling_params.output_kind is not RequestOutputKind.DELTA:
            sampling_params = dataclasses.replace(sampling_params, output_kind=RequestOutputKind.DELTA)
        stream = _RequestStream(asyncio.get_running_loop(), RequestOutputCollector())
        with self._lock:
            if self._dead_error is not None:
                raise self._new_dead_error()
            if request_id in self._streams:
                raise ValueError(f"request_id={request_id!r} is already in use; give each running request its own id")
            self._streams[request_id] = stream
        try:
            self._send(("add", request_id, prompt, sampling_params))
        except BaseException:  # it never reached the engine (a prompt that cannot be pickled, say)
            with self._lock:
                self._streams.pop(request_id, None)
            raise
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
                self._send_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request before the next step: its caller's stream ends with an output whose
        finish_reason is "abort" (nothing happens if it already finished)."""
        self._send_abort(request_id)

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine has stopped."""
        if self._dead_error is not None:
            raise self._new_dead_error()

    def shutdown(self) -> None:
        """Stop the engine (callers still waiting get EngineDeadError) and its process. No wait is
        unbounded: a process that has not ended ``SHUTDOWN_TIMEOUT_S`` after the request (stuck in a
        step, say) is killed, and the reader thread ends as the pipe closes with it."""
        if self._dead_error is None:
            # From a thread of its own: with the engine stuck and the pipe full, the send would not return.
            threading.Thread(target=self._send, args=(("shutdown",),), name="micro-vllm-shutdown", daemon=True).start()
        self._stop_process(SHUTDOWN_TIMEOUT_S)
        self._reader.join(SHUTDOWN_TIMEOUT_S)
        self._conn.close()

    def _stop_process(self, timeout: float) -> None:
        """Give the engine's process ``timeout`` seconds to end, then kill it."""
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(SHUTDOWN_TIMEOUT_S)
        atexit.unregister(self._process.terminate)

    def _send_abort(self, request_id: str) -> None:
        if self._dead_error is None:
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        """Send a command; one the engine can no longer get (its process is gone) is dropped, and
        the reader thread fails every caller as the pipe closes."""
        try:
            with self._send_lock:
                self._conn.send(command)
        except OSError:
            pass

    def _new_dead_error(self) -> EngineDeadError:
        """A caller's error, saying how the engine stopped: its own words, or the error a step raised."""
        dead = self._dead_error
        error = EngineDeadError(str(dead) if isinstance(dead, EngineDeadError) else f"the engine stopped: {dead!r}")
        error.__cause__ = dead
        return error

    # -- the reader thread ---------------------------------------------------------------------

    def _read_outputs(self) -> None:
        """Hand the engine's messages to their callers until it stops."""
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "outputs":
                    self._publish(*message[1:])
                elif kind == "refused":
                    with self._lock:
                        stream = self._streams.pop(message[1])
                    _deliver_soon(stream.loop, [(stream.collector, message[2])])
                elif kind == "stats":
                    self._log(message[1], None)
                else:  # "dead"
                    error = message[1]
                    break
        except EOFError:
            error = EngineDeadError(f"the engine process {_exit_status(self._process)}")
        except BaseException as failure:  # noqa: BLE001 - whatever stops the reader fails every caller
            error = failure
        self._die(error)

    def _publish(self, outputs: list[RequestOutput], scheduler_stats: SchedulerStats | None,
                 iteration_stats: IterationStats | None) -> None:
        """Hand a step's outputs to their callers, one wake-up per event loop, and log the step."""
        deliveries = defaultdict(list)
        with self._lock:
            streams = [self._streams.pop(o.request_id, None) if o.finished else self._streams.get(o.request_id)
                       for o in outputs]
        for output, stream in zip(outputs, streams):
            if stream is None:
                continue  # a caller already failed (its engine died meanwhile)
            if output.prompt_token_ids is None:
                output.prompt, output.prompt_token_ids = stream.prompt, stream.prompt_token_ids
            else:
                stream.prompt, stream.prompt_token_ids = output.prompt, output.prompt_token_ids
            deliveries[stream.loop].append((stream.collector, output))
        for loop, items in deliveries.items():
            _deliver_soon(loop, items)
        self._log(scheduler_stats, iteration_stats)

    def _log(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        for logger in self.stat_loggers:
            logger.record(scheduler_stats, iteration)

    def _die(self, error: BaseException) -> None:
        """Fail every waiting caller; later calls fail at once."""
        with self._lock:
            self._dead_error = error
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            _deliver_soon(stream.loop, [(stream.collector, self._new_dead_error())])


def _exit_status(process: multiprocessing.process.BaseProcess) -> str:
    """How the process ended ("exited with code 1", "was killed by SIGKILL"), once it has: its end of
    the pipe closes as it exits, a moment before its status can be read."""
    process.join(timeout=10)
    code = process.exitcode
    if code is None:
        return "closed its pipe but has not exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # a number without a name (a real-time signal)
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _deliver_soon(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestOutputCollector, object]]) -> None:
    def deliver() -> None:
        for collector, item in items:
            collector.put(item)

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is listening
