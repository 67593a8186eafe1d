"""The structured trace: what the engine did each step, written as one event (a dict) at a time.

This module owns the recording side: what a user may pass as ``LLMConfig(trace=...)`` (a JSON-lines
path, an object with ``emit(event)``, or a ``TraceConfig`` that also picks the level), the sinks, and
the ``Tracer`` the Engine calls once per step. Reading a trace back (summaries, plots, Chrome trace
export) lives in ``trace_tools.py``, so that tracing needs nothing beyond the standard library.

Events (every event has an ``"event"`` key; the full schema is in docs/trace.md):
- ``start``: once, with the run's settings (KV capacity, block size, budgets).
- ``step``: once per engine step, the state right after scheduling plus what finished in the step.
- ``abort``: a request aborted between steps.
- ``allocated`` / ``hit`` / ``freed`` / ``cached`` / ``evicted``: block-level events, only at level "block".
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

if TYPE_CHECKING:
    from micro_vllm.core.block import BlockPool
    from micro_vllm.core.scheduler import Scheduler
    from micro_vllm.core.scheduler_output import SchedulerOutput
    from micro_vllm.engine.engine import StepStats

TRACE_LEVELS = ("step", "block")


@runtime_checkable
class TraceSink(Protocol):
    """Anything that takes trace events. Each event is a fresh dict of JSON-ready values."""

    def emit(self, event: dict[str, Any]) -> None: ...


SinkSpec = Union[str, os.PathLike, TraceSink]


@dataclass(frozen=True)
class TraceConfig:
    """Where trace events go, and how fine they are.

    ``level="step"`` writes one event per step; ``level="block"`` adds an event for every block
    allocated, reused by a prefix-cache hit, freed, cached or evicted (many per step: for debugging the
    KV cache, not for timing).
    """

    sink: SinkSpec
    level: str = "step"

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

    def emit(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class Tracer:
    """Builds the trace events of one engine. The Engine calls it only when tracing is on."""

    def __init__(self, config: TraceConfig, block_pool: BlockPool, run_info: dict[str, Any]) -> None:
        sink = config.sink
        self._owned = JsonlSink(sink) if isinstance(sink, (str, os.PathLike)) else None
        self.sink: TraceSink = self._owned or sink
        self._t0 = time.perf_counter()
        self._step = 0
        # The pool records block events into this list only when it is not None; we drain it.
        self._pool = block_pool if config.level == "block" else None
        if self._pool is not None:
            self._pool.events = []
        self.sink.emit({"event": "start", "time": 0.0, "unix_time": time.time(), "level": config.level,
                        "kv_total_blocks": block_pool.num_usable_blocks, **run_info})

    def clock(self) -> float:
        """Seconds since the engine started, on a monotonic clock."""
        return time.perf_counter() - self._t0

    def step_event(
        self, plan: SchedulerOutput, stats: StepStats, scheduler: Scheduler, started: float
    ) -> dict[str, Any]:
        """The step's event as far as it is known after scheduling; ``emit_step`` completes it."""
        pool = scheduler.kv_cache_manager.block_pool
        requests = [
            {"id": rid, "tokens": n, "kind": "decode" if rid in stats.decode_req_ids else "prefill"}
            for rid, n in plan.num_scheduled_tokens.items()
        ]
        return {
            "event": "step",
            "step": self._step,
            "time": started,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_scheduled_tokens": plan.total_num_scheduled_tokens,
            "num_prefill_tokens": stats.num_prefill_tokens,
            "num_decode_tokens": stats.num_decode_tokens,
            "requests": requests,
            "kv_total_blocks": pool.num_usable_blocks,
            "kv_free_blocks": pool.get_num_free_blocks(),
            "kv_cached_blocks": len(pool.prefix_cache),
            # New requests enter the plan with the tokens the prefix cache served them.
            "prefix_cache_hit_tokens": sum(r.num_computed_tokens for r in plan.scheduled_new_reqs),
            "prefix_cache_query_tokens": sum(len(r.token_ids) for r in plan.scheduled_new_reqs),
            "preempted": sorted(plan.preempted_req_ids),
        }

    def emit_step(self, event: dict[str, Any], finished_ids: list[str]) -> None:
        event["finished"] = finished_ids
        event["duration"] = self.clock() - event["time"]
        self.sink.emit(event)
        self._drain_block_events()
        self._step += 1

    def record_abort(self, request_id: str, num_free_blocks: int) -> None:
        """An abort happens between steps; ``step`` names the step that comes next."""
        self.sink.emit({"event": "abort", "step": self._step, "time": self.clock(), "request_id": request_id,
                        "kv_free_blocks": num_free_blocks})
        self._drain_block_events()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.events = None
        if self._owned is not None:
            self._owned.close()

    def _drain_block_events(self) -> None:
        if self._pool is None or not self._pool.events:
            return
        for event in self._pool.events:
            self.sink.emit({**event, "step": self._step})
        self._pool.events.clear()
