"""The Executor of several ranks (vLLM's ``MultiprocExecutor``): one worker process per rank.

Start-up: one spawned process per rank (``worker_main``) builds the rank's ``Worker``, which joins
the other ranks through a TCP store on a free localhost port and loads its slice of the model, and
then says it is ready. If any rank fails to start, its error is raised here, and every process is
stopped.

A step: ``execute_model`` pickles the plan once, writes the bytes into each worker's pipe, and
returns a handle at once. Every rank runs the step (the model's collectives keep them together); rank
0 alone sends back the ``ModelRunnerOutput``. A worker calls its Worker in the order the in-process
executor does: it launches step N+1 before it waits for step N's tokens and sends them, so one step
stays in flight on the device while the engine plans the next; when the engine waits for the newest
step (the last of a run, a step under a grammar), the handle asks for it ("fetch"). A pipe per worker
and not a shared-memory ring as vLLM's ``MessageQueue``: pickling the plan costs more than moving its
bytes, and a pipe costs nothing while idle, where a ring's readers poll (docs/architecture.md, section 7).

Faults: a worker that raises sends its error and exits; one that dies is seen by its process's
sentinel. Either way every worker is stopped, and the call that waits, and every later one, raises
``EngineDeadError`` with the worker's error as its cause. A worker exits when its parent does: it
watches a pipe that only the parent holds open, which the kernel closes however the parent ends.
"""

from __future__ import annotations

import copyreg
import io
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import MappingProxyType
from typing import Any, NoReturn

import torch

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.config import LLMConfig
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.distributed import get_open_port
from micro_vllm.engine.exceptions import EngineDeadError
from micro_vllm.executor.abstract import Executor
from micro_vllm.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from micro_vllm.utils import freeze_start_up_heap, sigint_held_back
from micro_vllm.worker.worker import Worker

# How long stopping waits for the workers to leave their process groups before killing them (one
# that waits in a collective for a rank that died never leaves).
SHUTDOWN_GRACE_S = 5.0


# -- messages ----------------------------------------------------------------------------------


def _mapping_proxy(items: dict) -> MappingProxyType:
    return MappingProxyType(items)


# The plans hold read-only mappings, which pickle refuses: they travel as dicts and arrive read-only.
_DISPATCH_TABLE = {**copyreg.dispatch_table, MappingProxyType: lambda proxy: (_mapping_proxy, (dict(proxy),))}


def dumps(message: Any) -> bytes:
    """``message`` pickled, once for all the workers that receive it."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH_TABLE
    pickler.dump(message)
    return buffer.getvalue()


class RemoteTraceback(Exception):
    """Where a worker's error was raised: its traceback in the worker process, as text."""

    def __str__(self) -> str:
        return self.args[0]


# -- the engine's side -------------------------------------------------------------------------


@dataclass
class WorkerProcHandle:
    """One worker process and its pipes, as the executor holds them."""

    rank: int
    process: BaseProcess
    commands: Connection  # executor -> worker
    results: Connection  # worker -> executor
    death_writer: Connection  # never written; the worker exits when it closes


class MultiprocStepOutput(AsyncModelRunnerOutput):
    """A launched step; ``get_output`` waits for rank 0 to send its tokens."""

    def __init__(self, executor: MultiprocExecutor, step: int) -> None:
        self.executor = executor
        self.step = step

    def get_output(self) -> ModelRunnerOutput:
        return self.executor.wait_for_output(self.step)


class MultiprocExecutor(Executor):
    def __init__(self, config: LLMConfig, model_path, hf_config, max_model_len: int) -> None:
        world_size = config.parallel_config.world_size
        if config.model_config.device != "cpu" and torch.cuda.is_available() and world_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world_size} needs as many CUDA devices; this machine has "
                             f"{torch.cuda.device_count()}")
        # Spawned: a forked child would inherit this process' threads and CUDA state.
        context = multiprocessing.get_context("spawn")
        address = f"tcp://127.0.0.1:{get_open_port()}"
        num_threads = max(1, torch.get_num_threads() // world_size)  # the ranks share this process's CPU threads
        self.workers: list[WorkerProcHandle] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        self._started = False
        self._dead: BaseException | None = None  # the error that stopped the workers
        self._launched = 0  # the number of the last step launched
        self._requested = 0  # the workers send the outputs of the steps up to this one unasked
        try:
            for rank in range(world_size):
                args = (config, model_path, hf_config, max_model_len, rank, address, num_threads)
                self.workers.append(_start_worker(context, rank, args))
            self._collect_replies()  # each rank's "ready"
        except BaseException:
            self._finalizer()
            raise
        self._started = True

    # -- the Executor interface

    def get_attention_specs(self) -> list[AttentionSpec]:
        return self._call("get_attention_specs")

    def determine_num_blocks(self, max_blocks_per_request: int) -> int:
        return self._call("determine_num_blocks", max_blocks_per_request)  # the same on every rank (a MIN all-reduce)

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self._call("initialize_kv_cache", groups, num_blocks)

    def execute_model(self, plan: SchedulerOutput) -> AsyncModelRunnerOutput:
        self._launched += 1
        self._broadcast(("execute_model", (self._launched, plan)))
        self._requested = self._launched - 1  # a worker sends step N's output once it has launched N+1
        return MultiprocStepOutput(self, self._launched)

    def reset_batch(self) -> None:
        if self._dead is None:  # after a failure nothing runs, and the engine's rollback goes on without
            self._call("reset_batch")

    def shutdown(self) -> None:
        self._finalizer()
        self._dead = self._dead or RuntimeError("the executor was shut down")

    # -- messages

    def wait_for_output(self, step: int) -> ModelRunnerOutput:
        """Step ``step``'s output from rank 0, asking for it unless the workers send it unasked."""
        if self._requested < step:
            self._broadcast(("fetch", ()))
            self._requested = self._launched
        while True:
            _, message = self._next_message()
            if message[0] == "output" and message[1] == step:
                return message[2]
            # Otherwise the output of an earlier step, whose handle reset_batch dropped.

    def _call(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every rank's Worker; rank 0's result."""
        self._broadcast((method, args))
        return self._collect_replies()[0]

    def _collect_replies(self) -> dict[int, Any]:
        replies: dict[int, Any] = {}
        while len(replies) < len(self.workers):
            rank, message = self._next_message()
            if message[0] == "reply":
                replies[rank] = message[1]
            # Otherwise rank 0's output of a step whose handle reset_batch dropped.
        return replies

    def _broadcast(self, message: tuple) -> None:
        if self._dead is not None:
            raise self._dead_error()
        data = dumps(message)
        gone = False
        # To every rank or none: a Ctrl-C between two sends would leave the ranks that got a step
        # waiting in its collectives for one that never runs it, and the rollback waiting for them.
        with sigint_held_back():
            for worker in self.workers:
                try:
                    worker.commands.send_bytes(data)
                except OSError:  # that worker is gone: find out how, below
                    gone = True
                    break
        while gone:
            self._next_message()

    def _next_message(self) -> tuple[int, tuple]:
        """The next message of any worker. A worker's error or death stops them all and raises."""
        if self._dead is not None:
            raise self._dead_error()
        ready = wait([w.results for w in self.workers] + [w.process.sentinel for w in self.workers])
        for worker in self.workers:  # messages first: a worker that failed sent its error before exiting
            if worker.results in ready:
                try:
                    message = pickle.loads(worker.results.recv_bytes())
                except (EOFError, OSError):
                    self._fail(worker, None)
                if message[0] == "error":
                    _, error, remote_traceback = message
                    error.__cause__ = RemoteTraceback(remote_traceback)
                    self._fail(worker, error)
                return worker.rank, message
        self._fail(next(w for w in self.workers if w.process.sentinel in ready), None)

    def _fail(self, worker: WorkerProcHandle, error: BaseException | None) -> NoReturn:
        if error is None:
            worker.process.join(timeout=1)  # for its exit code
            error = RuntimeError(f"worker rank {worker.rank} (pid {worker.process.pid}) exited with code "
                                 f"{worker.process.exitcode}")
        self._finalizer()  # the other ranks may wait in a collective for this one forever
        if not self._started:
            raise error  # the rank's own error reaches the caller of the constructor
        self._dead = error
        raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        dead = EngineDeadError(f"the engine's workers stopped: {self._dead!r}")
        dead.__cause__ = self._dead
        return dead


def _start_worker(context, rank: int, args: tuple) -> WorkerProcHandle:
    commands_reader, commands = context.Pipe(duplex=False)
    results, results_writer = context.Pipe(duplex=False)
    death_reader, death_writer = context.Pipe(duplex=False)
    process = context.Process(target=worker_main, args=(*args, commands_reader, results_writer, death_reader),
                              name=f"micro-vllm-worker-{rank}", daemon=True)
    process.start()
    for child_end in (commands_reader, results_writer, death_reader):  # the child holds its own copies
        child_end.close()
    return WorkerProcHandle(rank, process, commands, results, death_writer)


def _stop_workers(workers: list[WorkerProcHandle]) -> None:
    """Ask every worker to leave, wait a grace time for it to, then kill what is left."""
    shutdown = dumps(("shutdown", ()))
    for worker in workers:
        try:
            worker.commands.send_bytes(shutdown)
        except OSError:
            pass  # gone already
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        for conn in (worker.commands, worker.results, worker.death_writer):
            conn.close()


# -- the worker's side -------------------------------------------------------------------------


def worker_main(config: LLMConfig, model_path, hf_config, max_model_len: int, rank: int, address: str,
                num_threads: int, commands: Connection, results: Connection, death_reader: Connection) -> None:
    """A worker process's target: build the rank's Worker, then serve the executor until shutdown."""
    # Ctrl-C reaches every process of the terminal's group: the engine decides what it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(death_reader,), name="micro-vllm-parent-watch",
                     daemon=True).start()
    torch.set_num_threads(num_threads)
    worker, exit_code = None, 0
    try:
        worker = Worker(config, model_path, hf_config, max_model_len, rank, address)
        results.send_bytes(dumps(("reply", None)))  # ready
        WorkerProc(worker, rank, results).serve(commands)
    except BaseException as error:  # noqa: BLE001 - the executor raises it
        _send_error(results, error)
        exit_code = 1
    finally:
        if worker is not None:
            worker.shutdown()
    # The interpreter's own teardown (unloading torch) takes seconds and does nothing a worker needs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _exit_with_parent(death_reader: Connection) -> None:
    try:
        death_reader.recv_bytes()  # nothing is ever sent: returns when the parent's end closes
    except (EOFError, OSError):
        pass
    os._exit(1)  # at once, even while the main thread waits in a collective


def _send_error(results: Connection, error: BaseException) -> None:
    """Send ``error`` and its traceback; the error as itself when it survives pickling, else as a
    RuntimeError that names it."""
    text = f"\n\nin worker process {os.getpid()}:\n" + "".join(traceback.format_exception(error))
    try:
        pickle.loads(dumps(error))
    except Exception:  # noqa: BLE001 - any error (un)pickling it
        error = RuntimeError(f"{type(error).__name__}: {error}")
    try:
        results.send_bytes(dumps(("error", error, text)))
    except OSError:
        pass  # the executor is gone


class WorkerProc:
    """Serves one rank's Worker: runs the executor's commands in order, rank 0 sending the results."""

    def __init__(self, worker: Worker, rank: int, results: Connection) -> None:
        self.worker = worker
        self.rank = rank
        self.results = results
        self.in_flight: deque[tuple[int, AsyncModelRunnerOutput]] = deque()  # launched, output not sent
        self.calls = {
            "get_attention_specs": worker.model_runner.get_attention_specs,
            "determine_num_blocks": worker.determine_num_blocks,
            "initialize_kv_cache": self.initialize_kv_cache,
            "reset_batch": self.reset_batch,
        }

    def serve(self, commands: Connection) -> None:
        while True:
            try:
                method, args = pickle.loads(commands.recv_bytes())
            except EOFError:
                return  # the executor is gone
            if method == "shutdown":
                return
            if method == "execute_model":
                self.execute_model(*args)
            elif method == "fetch":
                self.send_outputs()
            else:
                self.send("reply", self.calls[method](*args))

    def execute_model(self, step: int, plan: SchedulerOutput) -> None:
        output = self.worker.execute_model(plan)
        self.send_outputs()  # the steps before: launched first, this one runs while they are fetched
        self.in_flight.append((step, output))

    def send_outputs(self) -> None:
        while self.in_flight:
            step, output = self.in_flight.popleft()
            # Every rank fetches, so that every runner sees the same calls; rank 0's tokens go out.
            runner_output = output.get_output()
            if self.rank == 0:
                self.send("output", step, runner_output)

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self.worker.initialize_kv_cache(groups, num_blocks)
        freeze_start_up_heap()  # the last call of start-up: the steps come next

    def reset_batch(self) -> None:
        self.in_flight.clear()
        self.worker.reset_batch()

    def send(self, *message: Any) -> None:
        self.results.send_bytes(dumps(message))
