"""The trace's schema: every event the engine writes and every field of each, in one place.

A trace is a sequence of JSON objects, each with an ``"event"`` key naming its kind. ``tracer.py``
writes them and ``tools.py`` reads them back; docs/trace.md shows how to use them. Times are
seconds since the engine was created, from a monotonic clock (``time.perf_counter``).

- ``start``: once per engine, with the settings a reader needs.
- ``step``: once per engine step.
- ``abort``: a request aborted between steps.
- ``allocated`` / ``hit`` / ``freed`` / ``cached`` / ``evicted``: what happened to blocks, only at
  level "block"; they follow the ``step`` event of the step they happened in.
- ``end``: once, when the engine shuts down: the KV cache after the last frees.

A new event is a new TypedDict here, written by ``Tracer`` and listed in ``TraceEvent``.
"""

from __future__ import annotations

from typing import Literal, TypedDict, Union

from micro_vllm.core.block import BlockEventKind

TraceLevel = Literal["step", "block"]


class RunInfo(TypedDict):
    """The engine's settings, as the ``start`` event carries them."""

    model: str
    block_size: int
    enable_prefix_caching: bool
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int


class StartEvent(RunInfo):
    event: Literal["start"]
    time: float  # 0.0
    unix_time: float  # the wall clock at time 0.0
    level: TraceLevel
    kv_total_blocks: int  # usable blocks: the null block is not counted


class ScheduledRequest(TypedDict):
    """One request of a step's batch."""

    id: str
    tokens: int  # tokens it computes in the step
    # "decode" when it computes the one token it sampled last; "prefill" for a prompt chunk, or
    # recomputation after preemption.
    kind: Literal["prefill", "decode"]


class StepEvent(TypedDict):
    """One engine step. The state is read right after scheduling, while the step's blocks are held
    (so ``kv_free_blocks`` is the low point of the step). With async scheduling an engine step
    launches its plan and then applies the tokens of the step before, so ``finished`` lists the
    requests that stopped in the previous plan."""

    event: Literal["step"]
    step: int  # 0, 1, 2, ... per engine
    time: float  # when the engine step started, before scheduling
    duration: float  # from ``time`` to the step's outputs
    num_running: int  # the running list, after scheduling
    num_waiting: int  # the waiting queue, after scheduling
    num_scheduled_tokens: int  # num_prefill_tokens + num_decode_tokens
    num_prefill_tokens: int
    num_decode_tokens: int
    requests: list[ScheduledRequest]  # the batch, in order
    kv_total_blocks: int
    kv_free_blocks: int  # free blocks may still hold cached prefixes
    kv_cached_blocks: int  # blocks holding a prefix-cache hash, in use or free
    prefix_cache_hit_tokens: int  # tokens the prefix cache served to the requests admitted in the step
    # Tokens of the requests admitted in the step (the prompt, plus earlier output for one resumed
    # after preemption): what the cache was asked for.
    prefix_cache_query_tokens: int
    preempted: list[str]  # request ids preempted in the step
    finished: list[str]  # request ids whose finish (stop or length) this engine step applied


class AbortEvent(TypedDict):
    event: Literal["abort"]
    step: int  # aborts happen between steps: the step that comes next
    time: float
    request_id: str
    kv_free_blocks: int  # after its blocks were freed


class BlockEvent(TypedDict):
    """Blocks ``allocated`` (handed out), ``hit`` (a cached block reused by a request admitted in the
    step: a reference taken, a free one leaves the free queue), ``freed`` (only when the last
    reference went), ``cached`` (hashed once full) or ``evicted`` (its hash dropped because the
    block was handed out again, or every cached block at once when the prefix cache was reset)."""

    event: BlockEventKind
    step: int  # the step it happened in; between steps, the step that comes next
    block_ids: list[int]
    request_id: str | None  # None for a prefix-cache reset or the rollback of a failed step


class EndEvent(TypedDict):
    """The KV cache after the last frees, when the engine shuts down. Once every request is done no
    block is in use: ``kv_used_blocks`` > 0 with nothing running or waiting is a leak."""

    event: Literal["end"]
    step: int  # the number of steps the engine ran
    time: float
    kv_total_blocks: int
    kv_free_blocks: int
    kv_used_blocks: int
    kv_cached_blocks: int
    num_running: int  # requests still unfinished at shutdown
    num_waiting: int


TraceEvent = Union[StartEvent, StepEvent, AbortEvent, BlockEvent, EndEvent]
