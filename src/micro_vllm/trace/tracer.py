"""Recording a trace: what a user may pass as ``LLMConfig(trace=...)`` (a JSON-lines path, an object
with ``emit(event)``, or a ``TraceConfig`` that also picks the level), the sinks, and the ``Tracer``
the Engine calls. It reads only the plan and the scheduler's stats snapshots, and hears about blocks
as the block pool's listener. The events are defined in ``events.py``; reading a trace back lives in
``tools.py``. Tracing needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Union, get_args, runtime_checkable

from micro_vllm.trace.events import (
    AbortEvent,
    BlockEvent,
    EndEvent,
    RunInfo,
    ScheduledRequest,
    StartEvent,
    StepEvent,
    TraceEvent,
    TraceLevel,
)

if TYPE_CHECKING:
    from micro_vllm.core.block import BlockEventKind, BlockEventListener
    from micro_vllm.core.scheduler_output import SchedulerOutput
    from micro_vllm.metrics.stats import SchedulerStats

TRACE_LEVELS: tuple[TraceLevel, ...] = get_args(TraceLevel)


@runtime_checkable
class TraceSink(Protocol):
    """Anything that takes trace events. Each event is a fresh dict of JSON-ready values."""

    def emit(self, event: TraceEvent) -> None: ...


SinkSpec = Union[str, os.PathLike, TraceSink]


@dataclass(frozen=True)
class TraceConfig:
    """Where trace events go, and how fine they are.

    ``level="step"`` writes one event per step; ``level="block"`` adds an event for every block
    allocated, reused by a prefix-cache hit, freed, cached or evicted (many per step: for debugging the
    KV cache, not for timing).
    """

    sink: SinkSpec
    level: TraceLevel = "step"

    def __post_init__(self) -> None:
        if not _is_sink(self.sink):
            raise TypeError(
                f"trace sink={self.sink!r} is not allowed; give a path to a JSON-lines file or an object "
                f"with an emit(event) method"
            )
        if self.level not in TRACE_LEVELS:
            raise ValueError(f"trace level={self.level!r} is not allowed; choose one of {TRACE_LEVELS}")


def resolve_trace(trace: TraceConfig | SinkSpec | None) -> TraceConfig | None:
    """Turn the ``trace`` setting into a ``TraceConfig`` (None: tracing is off)."""
    if trace is None or isinstance(trace, TraceConfig):
        return trace
    if not _is_sink(trace):
        raise TypeError(
            f"trace={trace!r} is not allowed; give a JSON-lines path, an object with emit(event), "
            f"TraceConfig(sink, level=...) or None"
        )
    return TraceConfig(trace)


def _is_sink(sink: object) -> bool:
    if isinstance(sink, (str, os.PathLike)):
        return bool(os.fspath(sink))
    return callable(getattr(sink, "emit", None))


class JsonlSink:
    """One JSON object per line. Line buffered, so a trace can be read while the run goes on and
    nothing is lost when the process ends without a shutdown."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file = open(self.path, "w", buffering=1, encoding="utf-8")

    def emit(self, event: TraceEvent) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class Tracer:
    """Writes the trace events of one engine. The Engine calls it only when tracing is on; at level
    "block" it is also the block pool's listener, and holds the block events of a step until that
    step's own event is written."""

    def __init__(self, config: TraceConfig) -> None:
        sink = config.sink
        self._owned = JsonlSink(sink) if isinstance(sink, (str, os.PathLike)) else None
        self.sink: TraceSink = self._owned or sink
        self.level = config.level
        self._t0 = time.perf_counter()
        self._step = 0
        self._block_events: list[BlockEvent] = []

    @property
    def block_listener(self) -> BlockEventListener | None:
        """What to give the block pool: this tracer at level "block"; otherwise none, so the pool
        reports nothing."""
        return self if self.level == "block" else None

    def clock(self) -> float:
        """Seconds since the engine started, on a monotonic clock."""
        return time.perf_counter() - self._t0

    def record_start(self, run_info: RunInfo, stats: SchedulerStats) -> None:
        self._emit(StartEvent(event="start", time=0.0, unix_time=time.time(), level=self.level,
                              kv_total_blocks=stats.kv_total_blocks, **run_info))

    def record_step(self, plan: SchedulerOutput, stats: SchedulerStats, started: float, finished: list[str]) -> None:
        """One step: its plan and the snapshot made with it, and the requests whose finish it applied."""
        requests = [
            ScheduledRequest(id=rid, tokens=n, kind="decode" if rid in stats.decode_req_ids else "prefill")
            for rid, n in plan.num_scheduled_tokens.items()
        ]
        self._emit(StepEvent(
            event="step",
            step=self._step,
            time=started,
            duration=self.clock() - started,
            num_running=stats.num_running_reqs,
            num_waiting=stats.num_waiting_reqs,
            num_scheduled_tokens=plan.total_num_scheduled_tokens,
            num_prefill_tokens=stats.num_prefill_tokens,
            num_decode_tokens=stats.num_decode_tokens,
            requests=requests,
            kv_total_blocks=stats.kv_total_blocks,
            kv_free_blocks=stats.kv_free_blocks,
            kv_cached_blocks=stats.kv_cached_blocks,
            prefix_cache_hit_tokens=stats.prefix_cache_stats.hits,
            prefix_cache_query_tokens=stats.prefix_cache_stats.queries,
            preempted=sorted(plan.preempted_req_ids),
            finished=finished,
        ))
        self._step += 1

    def record_abort(self, request_id: str, stats: SchedulerStats) -> None:
        """An abort, with the KV cache of ``stats`` (a snapshot taken after its blocks were freed)."""
        self._emit(AbortEvent(event="abort", step=self._step, time=self.clock(), request_id=request_id,
                              kv_free_blocks=stats.kv_free_blocks))

    def on_block_event(self, kind: BlockEventKind, block_ids: list[int], request_id: str | None) -> None:
        self._block_events.append(BlockEvent(event=kind, step=self._step, block_ids=block_ids, request_id=request_id))

    def close(self, stats: SchedulerStats) -> None:
        """End the trace with the ``end`` event, from ``stats``, a snapshot taken at shutdown, after
        any block events still held; close the sink."""
        self._flush_block_events()
        self.sink.emit(EndEvent(
            event="end",
            step=self._step,
            time=self.clock(),
            kv_total_blocks=stats.kv_total_blocks,
            kv_free_blocks=stats.kv_free_blocks,
            kv_used_blocks=stats.kv_used_blocks,
            kv_cached_blocks=stats.kv_cached_blocks,
            num_running=stats.num_running_reqs,
            num_waiting=stats.num_waiting_reqs,
        ))
        if self._owned is not None:
            self._owned.close()

    def _emit(self, event: TraceEvent) -> None:
        """Write ``event``, then the block events held until now: what the pool did up to the end of
        a step follows that step's event."""
        self.sink.emit(event)
        self._flush_block_events()

    def _flush_block_events(self) -> None:
        for block_event in self._block_events:
            self.sink.emit(block_event)
        self._block_events.clear()
