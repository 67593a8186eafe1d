"""What the scheduler reports about each step: one frozen snapshot, read by the progress bar, the
trace and the Prometheus logger, so that none of them reaches into the scheduler or the pool.

Names follow vLLM's ``SchedulerStats`` where vLLM has the figure. The queue and KV figures are gauges:
the state when the snapshot is taken. The step's figures (tokens, prefix-cache queries and hits,
preemptions) count what that one step planned, so an exporter adds them up into counters.

The request side (``RequestStateStats``, ``IterationStats``, ``FinishedRequestStats``) is what the
engine measures as each step's tokens come back: tokens given out, time to first token, inter-token
latency, and each finished request's time queued, prefilling, decoding and in all.
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
    """One request's timings (vLLM's names; seconds on ``time.monotonic``, 0.0 until reached): its
    arrival at the engine, its entry into the scheduler's queue, its first scheduling, and the steps
    that gave its first and its latest token."""

    arrival_time: float
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    """What a finished request cost, for the per-request histograms. The phases are vLLM's: queued
    (arrival in the queue to first scheduling), prefill (to the first token), decode (first token to
    last) and inference (first scheduling to the last token). A request aborted before a phase ends
    spends the rest of its life in that phase."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float  # decode_time per token after the first; 0 for one token


@dataclass
class IterationStats:
    """What one engine step gave out (vLLM's name): tokens, the latencies measured at each token, and
    the requests that finished. Built by the engine (``LLMEngine.take_iteration_stats``) from each
    request's ``RequestStateStats``, so that the offline ``LLM`` and the server record the same."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token in this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    n_params: list[int] = field(default_factory=list)  # each finished user request's n
    max_num_generation_tokens: list[int] = field(default_factory=list)  # and its longest sequence

    def update_from_output(self, state: RequestStateStats, num_prompt_tokens: int, num_new_tokens: int,
                           now: float) -> None:
        """Count ``num_new_tokens`` that a request got in the step that ended at ``now``."""
        if state.first_token_ts == 0.0:
            state.first_token_ts = now
            self.num_prompt_tokens += num_prompt_tokens
            self.time_to_first_tokens.append(now - state.arrival_time)
        else:
            self.inter_token_latencies.append(now - state.last_token_ts)
        state.last_token_ts = now
        state.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens

    def update_from_finished(self, state: RequestStateStats, finish_reason: str, num_prompt_tokens: int,
                             max_tokens_param: int | None, now: float) -> None:
        scheduled = state.scheduled_ts or now
        first_token = state.first_token_ts or now
        last_token = state.last_token_ts or now
        decode_time = last_token - first_token
        num_decoded = state.num_generation_tokens - 1
        self.finished_requests.append(FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=now - state.arrival_time, num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=state.num_generation_tokens, max_tokens_param=max_tokens_param,
            queued_time=scheduled - state.queued_ts, prefill_time=first_token - scheduled, decode_time=decode_time,
            inference_time=last_token - scheduled,
            mean_time_per_output_token=decode_time / num_decoded if num_decoded > 0 else 0.0,
        ))

    def update_from_finished_user_request(self, n: int, max_num_generation_tokens: int) -> None:
        """A request the user sent (all ``n`` sequences of one with ``n > 1``) has finished."""
        self.n_params.append(n)
        self.max_num_generation_tokens.append(max_num_generation_tokens)
