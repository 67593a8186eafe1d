"""Data-parallel replicas behind one front end (vLLM's ``DPLBAsyncMPClient``, ``--data-parallel-size``).

``DataParallelAsyncLLM`` starts ``data_parallel_size`` engines, each an ``AsyncLLM`` of its own: its own
process, its own tensor-parallel ranks, and on CUDA its own devices (``ParallelConfig``). Each request
goes to the least-loaded replica and stays there: its outputs come from that replica, and its abort
goes to it. The load is vLLM's score, waiting * 4 + running: a waiting request costs a replica more
than a running one, which already has its KV cache and shares every step. Running is what the
replica reported with its last step (``SchedulerStats``); waiting is every request sent to it and not
finished, less those running, so a request counts from the moment it is sent, before the replica
reports it. Ties go to the lowest replica.

A replica that dies fails the requests it holds with its ``EngineDeadError``; the others' requests go
on. The front end is then ``errored`` (the server's ``/health`` answers 503 and the server exits, as
with one engine, so that a supervisor starts a fresh one); until it exits, new requests go to the
replicas still running.

Every replica's engine has the same ``seed``, as vLLM's replicas have: a request with its own seed
samples what it would on one engine, wherever it runs; an unseeded one draws from its replica's
generator, whose draws depend on what else ran there (as on one engine they depend on what else ran).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import AsyncGenerator, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from micro_vllm.config import LLMConfig
from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.async_llm import AsyncLLM
from micro_vllm.engine.engine import PromptType
from micro_vllm.engine.request_output import RequestOutput
from micro_vllm.metrics.stats import IterationStats, SchedulerStats
from micro_vllm.sampling.params import SamplingParams

__all__ = ["DataParallelAsyncLLM", "build_async_llm"]

# vLLM's weight of a waiting request against a running one in a replica's load.
WAITING_WEIGHT = 4


def build_async_llm(config: LLMConfig, stat_loggers: Iterable = ()) -> AsyncLLM | DataParallelAsyncLLM:
    """The front end ``config`` asks for: one ``AsyncLLM``, or ``data_parallel_size`` replicas."""
    if config.parallel_config.data_parallel_size == 1:
        return AsyncLLM(config, stat_loggers)
    return DataParallelAsyncLLM(config, stat_loggers)


class _Replica:
    """One replica: its engine, and the load the front end routes by. It is its engine's stat logger,
    to take the running count from each report and hand the report on, labelled with its index."""

    def __init__(self, index: int, stat_loggers: list) -> None:
        self.index = index
        self.stat_loggers = stat_loggers  # the front end's own list
        self.in_flight = 0  # sent here and not finished (the front end's count, under its lock)
        self.running = 0  # running at the last report
        self.engine: AsyncLLM  # set by start(), once the engine has its logger

    @classmethod
    def start(cls, config: LLMConfig, index: int, stat_loggers: list) -> _Replica:
        replica = cls(index, stat_loggers)
        parallel_config = dataclasses.replace(config.parallel_config, data_parallel_rank=index)
        replica.engine = AsyncLLM(dataclasses.replace(config, parallel_config=parallel_config), [replica])
        return replica

    @property
    def load(self) -> int:
        running = min(self.running, self.in_flight)  # a report can still count requests just finished
        return WAITING_WEIGHT * (self.in_flight - running) + running

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
        for logger in self.stat_loggers:
            logger.record(scheduler_stats, iteration_stats, engine_idx=self.index)


class DataParallelAsyncLLM:
    """``AsyncLLM``'s interface over ``data_parallel_size`` replicas. Building it starts every replica
    at once and waits until each has loaded the model; if one cannot start, the others are shut down
    and its error is raised. ``stat_loggers`` get ``record(scheduler_stats, iteration_stats,
    engine_idx=replica)``."""

    def __init__(self, config: LLMConfig, stat_loggers: Iterable = ()) -> None:
        _check_devices(config)
        self.stat_loggers = list(stat_loggers)
        size = config.parallel_config.data_parallel_size
        with ThreadPoolExecutor(size, thread_name_prefix="micro-vllm-replica-start") as pool:
            starting = [pool.submit(_Replica.start, config, index, self.stat_loggers) for index in range(size)]
        errors = [future.exception() for future in starting if future.exception() is not None]
        self._replicas = [future.result() for future in starting if future.exception() is None]
        if errors:
            self.shutdown()
            raise errors[0]
        first = self._replicas[0].engine
        self.tokenizer, self.max_model_len, self.vocab_size = first.tokenizer, first.max_model_len, first.vocab_size
        self._holders: dict[str, _Replica] = {}  # each request's replica, until it ends
        self._lock = threading.Lock()  # guards the holders and the in-flight counts

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, stat_loggers: Iterable = ()) -> DataParallelAsyncLLM:
        return cls(engine_args.create_engine_config(), stat_loggers)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """``AsyncLLM.generate`` on the least-loaded replica still running."""
        replica = self._route(request_id)
        try:
            async with contextlib.aclosing(replica.engine.generate(prompt, sampling_params, request_id)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            with self._lock:
                replica.in_flight -= 1
                del self._holders[request_id]

    async def abort(self, request_id: str) -> None:
        """Abort a request on its replica (nothing happens if it has already finished)."""
        replica = self._holders.get(request_id)
        if replica is not None:
            await replica.engine.abort(request_id)

    @property
    def errored(self) -> bool:
        """True once any replica has stopped: the server is no longer whole."""
        return any(replica.engine.errored for replica in self._replicas)

    def check_health(self) -> None:
        """Raise the EngineDeadError of the first replica that has stopped."""
        for replica in self._replicas:
            replica.engine.check_health()

    def shutdown(self) -> None:
        """Stop every replica and its process (callers still waiting get EngineDeadError), all at once:
        each waits for its process to exit."""
        with ThreadPoolExecutor(max(1, len(self._replicas)), thread_name_prefix="micro-vllm-replica-stop") as pool:
            list(pool.map(lambda replica: replica.engine.shutdown(), self._replicas))

    def _route(self, request_id: str) -> _Replica:
        with self._lock:
            if request_id in self._holders:
                raise ValueError(f"request_id={request_id!r} is already in use; give each running request its own id")
            running = [replica for replica in self._replicas if not replica.engine.errored]
            if not running:
                self.check_health()
            replica = min(running, key=lambda r: r.load)
            replica.in_flight += 1
            self._holders[request_id] = replica
        return replica


def _check_devices(config: LLMConfig) -> None:
    """On CUDA, refuse before anything starts a machine with fewer devices than the replicas' ranks."""
    parallel_config = config.parallel_config
    needed = parallel_config.data_parallel_size * parallel_config.tensor_parallel_size
    if config.model_config.device != "cpu" and torch.cuda.is_available() and needed > torch.cuda.device_count():
        raise ValueError(f"data_parallel_size={parallel_config.data_parallel_size} with tensor_parallel_size="
                         f"{parallel_config.tensor_parallel_size} needs {needed} CUDA devices (one per rank of "
                         f"each replica); this machine has {torch.cuda.device_count()}")
