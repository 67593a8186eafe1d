"""Property-based tests: the Scheduler and KVCacheManager under random workloads, with a fake runner.

Hypothesis draws the cache (block size 1/2/4/16, full attention, a sliding window or both as two
groups, prefix caching on or off, a capacity that holds the longest request alone plus a few blocks),
the budgets, sync or async scheduling, and the requests: arrival steps, prompts cut from a few shared prefixes (so prefix
hits, and blocks whose tokens repeat under other parents, are common), output lengths and aborts.
After every step the design notes' invariants are checked (``core_helpers.check_invariants``), and
the ``FakeRunner`` checks the plan and every K/V read; at the end every request has finished with
the output it asked for and every block is free. Some arrivals are several requests with one prompt
(the sequences of a parallel-sampling request: the first one leads, ``Request.prompt_leader``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.core_helpers import FULL, FakeRunner, check_all_free, check_invariants, make_request, make_scheduler, sliding
from micro_vllm.core.request import Request, RequestStatus

SPECS = {"full": lambda w: (FULL,), "sliding": lambda w: (sliding(w),), "full+sliding": lambda w: (FULL, sliding(w))}
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: tuple[int, ...]
    max_tokens: int
    abort_after: int | None  # steps after arrival; None: runs to the end
    n: int = 1  # requests with this prompt, the first one their prompt leader
    stop_token: int | None = None  # a token of the fake runner's vocabulary that ends the request


@dataclass(frozen=True)
class Scenario:
    block_size: int
    specs: str
    window: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    enable_caching: bool
    extra_blocks: int  # beyond what the longest request needs
    arrivals: tuple[Arrival, ...]
    async_scheduling: bool = False

    def make_scheduler(self, enable_caching: bool | None = None, extra_blocks: int | None = None):
        specs = SPECS[self.specs](self.window)
        config = dict(
            block_size=self.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, specs=specs,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_caching=self.enable_caching if enable_caching is None else enable_caching,
        )
        # Just enough blocks for the longest request alone (what ``check_fits`` asks: with chunked
        # prefill, a sliding window in one-token steps), plus extra.
        longest = max(min(len(a.prompt) + a.max_tokens, self.max_model_len) for a in self.arrivals)
        probe = make_scheduler(num_blocks=2, **config).kv_cache_manager
        smallest_chunk = 1 if self.enable_chunked_prefill else self.max_num_batched_tokens
        one_request = probe.max_blocks_needed(longest, smallest_chunk)
        extra = self.extra_blocks if extra_blocks is None else extra_blocks
        return make_scheduler(num_blocks=1 + one_request + extra, **config)


@st.composite
def arrivals(draw, prefixes: list[list[int]], max_model_len: int) -> Arrival:
    prefix = draw(st.sampled_from(prefixes))
    cut = draw(st.one_of(st.just(len(prefix)), st.integers(0, len(prefix))))  # often the whole prefix
    # A tiny alphabet: suffixes often repeat whole blocks of other requests under other parents.
    suffix = draw(st.lists(st.integers(1, 3), max_size=20))
    prompt = (prefix[:cut] + suffix)[: max_model_len - 1] or [1]
    abort_after = draw(st.one_of(st.none(), st.none(), st.integers(0, 12)))
    n = draw(st.sampled_from([1, 1, 1, 2, 3]))
    stop_token = draw(st.one_of(st.none(), st.none(), st.integers(0, 4)))
    return Arrival(draw(st.integers(0, 8)), tuple(prompt), draw(st.integers(1, 24)), abort_after, n, stop_token)


@st.composite
def scenarios(draw, aborts: bool = True) -> Scenario:
    max_model_len = draw(st.integers(4, 64))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 48))
    if not chunked:  # without chunking a whole prompt must fit in one step
        budget = max(budget, max_model_len)
    prefixes = draw(st.lists(st.lists(st.integers(1, 3), min_size=4, max_size=48), min_size=1, max_size=3))
    requests = draw(st.lists(arrivals(prefixes, max_model_len), min_size=1, max_size=10))
    if not aborts:
        requests = [Arrival(a.step, a.prompt, a.max_tokens, None, a.n, a.stop_token) for a in requests]
    return Scenario(
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        specs=draw(st.sampled_from(list(SPECS))),
        window=draw(st.integers(1, 20)),
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        enable_chunked_prefill=chunked,
        enable_caching=draw(st.sampled_from([True, True, False])),
        extra_blocks=draw(st.sampled_from([0, 0, 1, 3, 20])),
        arrivals=tuple(requests),
        async_scheduling=draw(st.booleans()),
    )


def run(
    scenario: Scenario, scheduler, max_steps: int = 20_000, async_scheduling: bool | None = None
) -> tuple[list[Request], set[str], FakeRunner]:
    """Add, abort and step as the scenario says until nothing is left; return requests and aborts."""
    if async_scheduling is None:
        async_scheduling = scenario.async_scheduling
    runner = FakeRunner(scheduler, async_scheduling=async_scheduling)
    groups = [same_prompt_requests(a) for a in scenario.arrivals]
    aborted: set[str] = set()
    for step in range(max_steps):
        for arrival, group in zip(scenario.arrivals, groups):
            if arrival.step == step:
                for request in group:
                    scheduler.add_request(request)
            if arrival.abort_after is not None and arrival.step + arrival.abort_after == step:
                ids = [r.request_id for r in group]
                aborted.update(r.request_id for r in scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))
                check_invariants(scheduler)
        if step > max(a.step for a in scenario.arrivals) and not scheduler.has_unfinished_requests():
            return [r for group in groups for r in group], aborted, runner
        runner.step()
    raise AssertionError("deadlock: requests did not finish")


def same_prompt_requests(arrival: Arrival) -> list[Request]:
    stop_token_ids = [] if arrival.stop_token is None else [arrival.stop_token]
    requests = [make_request(list(arrival.prompt), max_tokens=arrival.max_tokens, stop_token_ids=stop_token_ids)
                for _ in range(arrival.n)]
    for request in requests[1:]:
        request.prompt_leader = requests[0]
    return requests


def expected_output_len(request: Request, max_model_len: int) -> int:
    return min(request.sampling_params.max_tokens, max_model_len - request.num_prompt_tokens)


@PROPERTY_SETTINGS
@given(scenarios())
def test_invariants_hold_after_every_step(scenario):
    scheduler = scenario.make_scheduler()
    requests, aborted, _ = run(scenario, scheduler)
    check_all_free(scheduler)
    for request in requests:
        assert request.is_finished, f"{request} was lost"
        if request.request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            continue
        stop_token_ids = request.sampling_params.stop_token_ids
        output = request.output_token_ids
        assert not set(output[:-1]) & set(stop_token_ids), f"{request} went on past a stop token"
        if request.finish_reason == "stop":
            assert output[-1] in stop_token_ids and len(output) <= expected_output_len(request, scenario.max_model_len)
        else:
            assert request.finish_reason == "length"
            assert request.num_output_tokens == expected_output_len(request, scenario.max_model_len)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(aborts=False))
def test_outputs_do_not_depend_on_caching_or_capacity(scenario):
    """The fake runner samples from the prefix alone, like greedy decoding: prefix hits, preemption,
    chunking and async scheduling change how a request is computed, never what it outputs."""
    tight_cached = run(scenario, scenario.make_scheduler(enable_caching=True, extra_blocks=0), async_scheduling=True)[0]
    roomy_uncached = run(scenario, scenario.make_scheduler(enable_caching=False, extra_blocks=500),
                         async_scheduling=False)[0]
    assert [r.output_token_ids for r in tight_cached] == [r.output_token_ids for r in roomy_uncached]


def test_tiny_cache_with_many_requests_preempts_and_finishes():
    """The issue's example: room for one max-length request, many requests, no deadlock."""
    scenario = Scenario(
        block_size=2, specs="full", window=4, max_model_len=32, max_num_batched_tokens=8, max_num_seqs=8,
        enable_chunked_prefill=True, enable_caching=True, extra_blocks=0,
        arrivals=tuple(Arrival(0, tuple(range(1, 10 + i)), 20, None) for i in range(8)),
    )
    scheduler = scenario.make_scheduler()
    requests, _, runner = run(scenario, scheduler)
    assert runner.num_preempted > 0
    assert all(r.num_output_tokens == expected_output_len(r, 32) for r in requests)
    check_all_free(scheduler)
