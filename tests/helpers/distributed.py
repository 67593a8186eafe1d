"""Several tensor-parallel ranks on the CPU for tests: processes joined by gloo that run test functions.

``RankPool(world_size)`` starts one spawned process per rank, each in the process groups a worker
sets up (``init_distributed_environment`` and ``initialize_model_parallel`` over gloo), on one torch
thread. ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank at once and returns the ranks'
results in rank order; ``fn`` must be importable by name (a module-level function of a test module
or helper) and its arguments picklable. An error on any rank fails the call with that rank's
traceback and closes the pool (the other ranks may wait in a collective that will never complete).
Starting the processes is what costs: share one pool across tests, and start another once one is closed.
``process_running(pid)`` tells whether a process the tests started is still there.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import torch

from micro_vllm.distributed import get_open_port, init_distributed_environment, initialize_model_parallel

# Generous: a test's work takes well under a second; this only turns a hung collective into a failure.
ANSWER_TIMEOUT_S = 120


class RankPool:
    def __init__(self, world_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        address = f"tcp://127.0.0.1:{get_open_port()}"
        self.conns: list[Connection] = []
        self.processes = []
        self.closed = False
        for rank in range(world_size):
            conn, child_conn = context.Pipe()
            process = context.Process(target=_serve, args=(rank, world_size, address, child_conn),
                                      name=f"rank-pool-{rank}", daemon=True)
            process.start()
            child_conn.close()
            self.conns.append(conn)
            self.processes.append(process)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args))
        results: dict[int, Any] = {}
        while len(results) < len(self.conns):
            ready = wait([c for r, c in enumerate(self.conns) if r not in results], timeout=ANSWER_TIMEOUT_S)
            if not ready:
                self.close()
                raise AssertionError(f"ranks {sorted(set(range(len(self.conns))) - set(results))} did not answer")
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", f"rank {rank} exited with {self.processes[rank].exitcode}"
                if status == "error":
                    self.close()
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                results[rank] = value
        return [results[rank] for rank in range(len(self.conns))]

    def close(self) -> None:
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass  # that rank is gone already
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _serve(rank: int, world_size: int, address: str, conn: Connection) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(world_size, rank, address, "gloo")
    initialize_model_parallel(world_size, "gloo")
    while (task := conn.recv()) is not None:
        fn, args = task
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - the test reports it
            conn.send(("error", traceback.format_exc()))
    os._exit(0)  # skips the interpreter's teardown, seconds of unloading torch



def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
