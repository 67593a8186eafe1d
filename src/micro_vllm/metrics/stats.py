"""What the scheduler reports about each step: one frozen snapshot, read by the progress bar, the
trace and the Prometheus logger, so that none of them reaches into the scheduler or the pool.

Names follow vLLM's ``SchedulerStats`` where vLLM has the figure. The queue and KV figures are gauges:
the state when the snapshot is taken. The step's figures (tokens, prefix-cache queries and hits,
preemptions) count what that one step planned, so an exporter adds them up into counters.

The output side (``IterationStats``, ``RequestStateStats``) is what the async engine measures as
outputs reach their consumers: tokens given out, time to first token, inter-token and end-to-end latency.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class RequestStateStats:
    """One request's timings as its outputs reach the user (seconds on ``time.monotonic``)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    """What a finished request cost, for the per-request histograms."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # From the first token to the last; 0 for a single token; None where the tokens' times were not
    # seen (the offline LLM sees a request only once it has finished).
    mean_time_per_output_token: float | None


@dataclass
class IterationStats:
    """What the outputs of one engine step gave the users (vLLM's name): tokens, and the latencies
    that only the output side sees. ``RequestStateStats`` carries each request between steps."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token in this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def update_from_output(self, state: RequestStateStats, num_prompt_tokens: int, num_new_tokens: int,
                           finish_reason: str | None, now: float) -> None:
        if num_new_tokens:
            if state.first_token_time is None:
                state.first_token_time = now
                self.num_prompt_tokens += num_prompt_tokens
                self.time_to_first_tokens.append(now - state.arrival_time)
            else:
                self.inter_token_latencies.append(now - state.last_token_time)
            state.last_token_time = now
            state.num_generation_tokens += num_new_tokens
            self.num_generation_tokens += num_new_tokens
        if finish_reason is not None:
            decode_tokens = state.num_generation_tokens - 1
            decode_time = (state.last_token_time - state.first_token_time) if decode_tokens > 0 else 0.0
            self.finished_requests.append(FinishedRequestStats(
                finish_reason=finish_reason, e2e_latency=now - state.arrival_time,
                num_prompt_tokens=num_prompt_tokens, num_generation_tokens=state.num_generation_tokens,
                mean_time_per_output_token=decode_time / decode_tokens if decode_tokens > 0 else 0.0,
            ))

    def update_from_finished(self, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int,
                             e2e_latency: float) -> None:
        """Count a request seen only once it has finished (the offline ``LLM.generate``): its tokens
        and its latency from arrival to the end. Its tokens' own times were not seen, so it adds no
        time to first token, inter-token latency or time per output token."""
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.finished_requests.append(FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=e2e_latency, num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens, mean_time_per_output_token=None,
        ))
