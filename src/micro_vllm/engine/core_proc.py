"""The engine's own process for ``AsyncLLM`` (vLLM's ``EngineCoreProc``): the step loop, fed over a pipe.

It owns an ``LLMEngine`` and runs it as the offline loop does: between steps it applies the requests and
aborts that have come in, steps while anything is unfinished, and blocks on the pipe when idle. What it
sends back, in order, one message each:

- ``("ready", max_model_len, vocab_size)`` once the engine is built;
- ``("outputs", outputs, scheduler_stats)`` for each step that made outputs (``scheduler_stats`` None
  for an abort's output); a request's prompt and prompt token ids travel with its first output only;
- ``("refused", request_id, error)`` for a request the engine refuses;
- ``("stats", scheduler_stats)`` whenever the engine falls idle, and at shutdown;
- ``("dead", error)`` last, when the loop stops: shutdown, an error in a step, or an engine that
  could not be built.
"""

from __future__ import annotations

import pickle
import signal
from multiprocessing.connection import Connection

from micro_vllm.config import LLMConfig
from micro_vllm.engine.engine import LLMEngine
from micro_vllm.engine.exceptions import EngineDeadError
from micro_vllm.engine.request_output import RequestOutput


def run_engine_core(config: LLMConfig, conn: Connection) -> None:
    """The process' target: build the engine, then serve the pipe until shutdown or death."""
    # A Ctrl-C reaches the whole process group; the server, not the signal, decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(config)
    except BaseException as error:  # noqa: BLE001 - the caller of AsyncLLM() gets it
        conn.send(("dead", _picklable(error)))
        return
    try:
        conn.send(("ready", engine.max_model_len, engine.vocab_size))
        EngineCoreProc(engine, conn).run()
    finally:
        engine.shutdown()


class EngineCoreProc:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.announced: set[str] = set()  # requests whose prompt has gone out with an output

    def run(self) -> None:
        engine = self.engine
        try:
            while self._apply_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self.conn.send(("outputs", self._compact(outputs), engine.last_step_stats))
                if not engine.has_unfinished_requests():
                    self.conn.send(("stats", engine.scheduler.make_stats()))
            self.conn.send(("stats", engine.scheduler.make_stats()))
            error: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as failure:  # noqa: BLE001 - whatever stops the loop fails every caller
            error = failure
        try:
            self.conn.send(("dead", _picklable(error)))
        except OSError:
            pass  # the other side is gone: nobody to tell

    def _apply_commands(self, block: bool) -> bool:
        """Apply every command that has come in, waiting for one when ``block``; False on shutdown
        (asked for, or the other end closed)."""
        if not block and not self.conn.poll():
            return True
        try:
            while True:
                command = self.conn.recv()
                if command[0] == "shutdown":
                    return False
                if command[0] == "abort":
                    self._abort(command[1])
                else:
                    self._add(*command[1:])
                if not self.conn.poll():
                    return True
        except EOFError:
            return False

    def _add(self, request_id: str, prompt, params) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError) as error:
            self.conn.send(("refused", request_id, _picklable(error)))

    def _abort(self, request_id: str) -> None:
        outputs = self.engine.abort_request(request_id)
        if outputs:
            self.conn.send(("outputs", self._compact(outputs), None))

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


def _picklable(error: BaseException) -> BaseException:
    """The error itself if it crosses the pipe, else a RuntimeError that names it."""
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - any error pickling it
        return RuntimeError(f"{type(error).__name__}: {error}")
