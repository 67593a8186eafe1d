"""What the scheduler reports about each step: one frozen snapshot, read by the progress bar, the
trace and (later) metrics exporters, so that none of them reaches into the scheduler or the pool.

Names follow vLLM's ``SchedulerStats`` where vLLM has the figure. The queue and KV figures are gauges:
the state when the snapshot is taken. The step's figures (tokens, prefix-cache queries and hits,
preemptions) count what that one step planned, so an exporter adds them up into counters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's answers to the requests admitted in one step, in tokens."""

    queries: int = 0  # tokens of the admitted requests (a resumed one's earlier output too): what was looked up
    hits: int = 0  # of those, tokens served by cached blocks


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state right after planning a step, and what that step computes. A snapshot
    taken between steps (``Scheduler.make_stats()``) has the state only; its step figures are zero."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_total_blocks: int  # usable blocks: the null block is not counted
    kv_free_blocks: int  # free blocks may still hold cached prefixes
    kv_cached_blocks: int  # blocks holding a prefix-cache hash, in use or free
    num_prefill_tokens: int = 0  # prompt chunks, and recomputation after preemption
    num_decode_tokens: int = 0  # one per request that computes the token it sampled last
    decode_req_ids: frozenset[str] = frozenset()  # the rest of the step's requests prefill
    prefix_cache_stats: PrefixCacheStats = PrefixCacheStats()
    num_preempted_reqs: int = 0

    @property
    def kv_used_blocks(self) -> int:
        return self.kv_total_blocks - self.kv_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of usable blocks in use (vLLM's gauge)."""
        return self.kv_used_blocks / self.kv_total_blocks
