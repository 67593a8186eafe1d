"""The engine's own process for ``AsyncLLM`` (vLLM's ``EngineCoreProc``): the step loop, fed over a pipe.

It owns an ``LLMEngine`` and runs it as the offline loop does: between steps it applies the requests and
aborts that have come in, steps while anything is unfinished, and blocks when idle. An input thread
(vLLM's engine core has one too) reads the pipe all the time into a queue, and the loop applies
everything in the queue before it plans each step. Read only between steps, the pipe would fill up
during a long step (seconds on a CPU): the server's event loop would wait in its send, seeing no
client leave meanwhile, and a burst of adds would come in a few per step, each scheduled, and so
prefilled, before the aborts behind it.

A structured-output request is checked at once (``LLMEngine.make_request``: a request the engine refuses
fails its caller before anything runs), then waits while its grammar compiles on a thread of its own
(``PendingGrammars``), and is added to the engine once the grammar is ready, as vLLM compiles grammars
asynchronously and schedules the request when its grammar is: a grammar can take seconds to compile (a
deep schema, a choice of thousands of options), and compiling it in the step loop would pause every
stream. xgrammar releases the GIL while it compiles, so the steps go on meanwhile. An abort of a request
still compiling ends it at once; a grammar that fails to compile fails only its caller.

What it sends back, in order, one message each:

- ``("ready", max_model_len, vocab_size)`` once the engine is built;
- ``("outputs", outputs, scheduler_stats, iteration_stats)`` for each step, and for each abort that
  made an output (``scheduler_stats`` None then); a request's prompt and prompt token ids travel with
  its first output only. A request aborted while its grammar compiles never reached the engine, and
  its ``iteration_stats`` count nothing;
- ``("refused", request_id, error)`` for a request the engine refuses;
- ``("stats", scheduler_stats)`` at start, whenever the engine falls idle, and at shutdown;
- ``("dead", error)`` last, when the loop stops: shutdown, an error in a step, or an engine that
  could not be built.

An output thread (vLLM's engine core has one too) pickles and sends them, in order: in the step loop,
a step's outputs (a few hundred objects) would take a millisecond or more to pickle and could wait on
a full pipe while the other side catches up, and every step would wait with them. On a GPU the thread
does it while the loop waits for the next step's tokens, holding no GIL.
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from micro_vllm.config import LLMConfig
from micro_vllm.core.request import Request
from micro_vllm.engine.engine import LLMEngine
from micro_vllm.engine.exceptions import EngineDeadError
from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
from micro_vllm.utils import exit_with_parent, freeze_start_up_heap

if TYPE_CHECKING:
    from micro_vllm.structured_output.manager import StructuredOutputGrammar

logger = logging.getLogger(__name__)


def run_engine_core(config: LLMConfig, conn: Connection) -> None:
    """The process' target: build the engine, then serve the pipe until shutdown or death."""
    # A Ctrl-C reaches the whole process group; the server, not the signal, decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # It ends with the process that started it: one killed before it could shut the engine down leaves
    # nobody to read its outputs or stop it, and a step that never returns would never see the pipe close.
    exit_with_parent()
    try:
        engine = LLMEngine(config)
    except BaseException as error:  # noqa: BLE001 - the caller of AsyncLLM() gets it
        conn.send(("dead", _picklable(error)))
        return
    if engine.tokenizer is not None and engine.eos_token_ids:  # else make_request refuses every constraint
        _load_structured_output(engine)
    try:
        conn.send(("ready", engine.max_model_len, engine.vocab_size))
        EngineCoreProc(engine, conn).run()
    finally:
        engine.shutdown()


def _load_structured_output(engine: LLMEngine) -> None:
    """Build the structured-output manager before any request: with the first constraint, loading
    xgrammar and reading the vocabulary (a second or more on a CPU) would pause every stream. A
    tokenizer xgrammar cannot read fails the constraints only, when they come."""
    try:
        engine.get_structured_output_manager()
    except Exception:  # noqa: BLE001 - the same error reaches each constraint's caller
        logger.warning("structured output is unavailable for this tokenizer", exc_info=True)


class EngineCoreProc:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.announced: set[str] = set()  # requests whose prompt has gone out with an output
        # For good here, where the process is the engine's; an offline LLM freezes its caller's heap
        # only while it generates (``heap_frozen``).
        freeze_start_up_heap()
        # The commands from the pipe, ("compiled",) whenever a grammar has compiled, and ("failed", error)
        # when a command cannot be read or a message sent, in order.
        self.input_queue: queue.Queue[tuple] = queue.Queue()
        self.grammars = PendingGrammars(lambda: self.input_queue.put(("compiled",)))
        threading.Thread(target=self._read_commands, name="micro-vllm-inputs", daemon=True).start()
        self.output_queue: queue.Queue[tuple] = queue.Queue()  # the messages to send, in order
        self.output_thread = threading.Thread(target=self._send_outputs, name="micro-vllm-outputs", daemon=True)
        self.output_thread.start()

    def run(self) -> None:
        engine = self.engine
        try:
            self._send(("stats", engine.scheduler.make_stats()))  # the loggers learn the KV cache's size
            while self._handle_inputs(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._send(("outputs", self._compact(outputs), engine.last_step_stats,
                                engine.take_iteration_stats()))
                if not engine.has_unfinished_requests():
                    self._send(("stats", engine.scheduler.make_stats()))
            self._send(("stats", engine.scheduler.make_stats()))
            error: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as failure:  # noqa: BLE001 - whatever stops the loop fails every caller
            error = failure
        self.grammars.shutdown()
        self._send(("dead", _picklable(error)))
        self.output_thread.join()  # everything sent before the process ends

    def _send(self, message: tuple) -> None:
        self.output_queue.put(message)

    def _send_outputs(self) -> None:
        """The output thread: each message to the pipe, until "dead" has gone or the other side is gone.
        A message that cannot be sent otherwise (pickling failed) stops the loop with its error."""
        while True:
            message = self.output_queue.get()
            try:
                self.conn.send(message)
            except OSError:
                return  # the other side is gone: nobody to tell
            except BaseException as error:  # noqa: BLE001 - the loop raises it, and "dead" follows
                self.input_queue.put(("failed", error))
                continue
            if message[0] == "dead":
                return

    def _read_commands(self) -> None:
        """The input thread: each command into the queue as it comes, until shutdown; the other end
        closing is a shutdown, and a command that cannot be read stops the loop with its error."""
        try:
            while True:
                command = self.conn.recv()
                self.input_queue.put(command)
                if command[0] == "shutdown":
                    return
        except EOFError:
            self.input_queue.put(("shutdown",))
        except BaseException as error:  # noqa: BLE001 - the loop raises it
            self.input_queue.put(("failed", error))

    def _handle_inputs(self, block: bool) -> bool:
        """Apply every command in the queue, and add the requests whose grammar has compiled, waiting
        for one when ``block``; False on shutdown (asked for, or the other end closed)."""
        try:
            command = self.input_queue.get(block=block)
        except queue.Empty:
            return True
        while self._apply(command):
            try:
                command = self.input_queue.get_nowait()
            except queue.Empty:
                return True
        return False

    def _apply(self, command: tuple) -> bool:
        """Apply one command; False on shutdown."""
        kind = command[0]
        if kind == "shutdown":
            return False
        if kind == "failed":  # a command could not be read, or a message sent
            raise command[1]
        if kind == "compiled":
            self._add_compiled()
        elif kind == "abort":
            self._abort(command[1])
        else:
            self._add(*command[1:])
        return True

    def _add(self, request_id: str, prompt, params) -> None:
        """Check and add a request; one with a constraint waits for its grammar to compile."""
        try:
            if request_id in self.grammars.requests:
                raise ValueError(f"request_id={request_id!r} is already in use")
            request = self.engine.make_request(request_id, prompt, params)
        except Exception as error:  # noqa: BLE001 - it only checks and builds: whatever it raises is this request's
            self._refuse(request_id, error)
            return
        if params.structured_outputs is not None:
            try:
                manager = self.engine.get_structured_output_manager()
            except Exception as error:  # noqa: BLE001 - xgrammar cannot read this tokenizer (logged at start-up)
                self._refuse(request_id, error)
                return
            self.grammars.submit(request, lambda: manager.grammar_init(params.structured_outputs))
            return
        try:
            self.engine.add_request(request_id, request)
        except (ValueError, TypeError) as error:
            self._refuse(request_id, error)

    def _add_compiled(self) -> None:
        """Add the requests whose grammar has compiled; refuse those whose grammar failed to."""
        for request, compiled in self.grammars.take_finished():
            error = compiled.exception()  # whatever the compile raised (xgrammar raises RuntimeError from C++)
            if error is not None:
                self.engine.prompts.pop(request.request_id, None)  # made, never added
                self._refuse(request.request_id, error)
                continue
            request.grammar = compiled.result()
            try:
                self.engine.add_request(request.request_id, request)
            except (ValueError, TypeError) as refusal:
                self._refuse(request.request_id, refusal)

    def _abort(self, request_id: str) -> None:
        request = self.grammars.cancel(request_id)
        if request is not None:
            outputs = [_aborted_output(request, self.engine.prompts.pop(request_id, None))]
        else:
            outputs = self.engine.abort_request(request_id)
        if outputs:
            self._send(("outputs", self._compact(outputs), None, self.engine.take_iteration_stats()))

    def _refuse(self, request_id: str, error: BaseException) -> None:
        self._send(("refused", request_id, _picklable(error)))

    def _compact(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Send a request's prompt with its first output only: the other side keeps it from there."""
        for output in outputs:
            if output.request_id in self.announced:
                output.prompt, output.prompt_token_ids = None, None
            else:
                self.announced.add(output.request_id)
            if output.finished:
                self.announced.discard(output.request_id)
        return outputs


class PendingGrammars:
    """Requests whose grammar compiles on a thread beside the step loop; ``wake`` is called whenever
    a compile has finished. One compile at a time, each on at most half the CPUs (the manager's
    compiler), so that compiling never takes more than half the machine from the steps."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="micro-vllm-grammar")
        self.wake = wake
        self.requests: dict[str, tuple[Request, Future]] = {}

    def submit(self, request: Request, compile_grammar: Callable[[], StructuredOutputGrammar]) -> None:
        compiled = self.executor.submit(compile_grammar)
        self.requests[request.request_id] = (request, compiled)
        compiled.add_done_callback(lambda _: self.wake())

    def take_finished(self) -> list[tuple[Request, Future]]:
        """The requests whose compile has finished (its future holds the grammar or the error)."""
        finished = [(request, compiled) for request, compiled in self.requests.values() if compiled.done()]
        for request, _ in finished:
            del self.requests[request.request_id]
        return finished

    def cancel(self, request_id: str) -> Request | None:
        """Forget a request still compiling (a compile under way runs to its end, unused)."""
        request, compiled = self.requests.pop(request_id, (None, None))
        if compiled is not None:
            compiled.cancel()
        return request

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _aborted_output(request: Request, prompt: str | None) -> RequestOutput:
    """The last output of a request aborted before it was added: each sequence empty, "abort"."""
    sequences = [CompletionOutput(index, "", [], None, None, finish_reason="abort")
                 for index in range(request.sampling_params.n)]
    return RequestOutput(request.request_id, prompt, request.prompt_token_ids, None, sequences, finished=True,
                         num_cached_tokens=0)


def _picklable(error: BaseException) -> BaseException:
    """The error itself if it crosses the pipe, else a RuntimeError that names it."""
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - any error pickling it
        return RuntimeError(f"{type(error).__name__}: {error}")
