"""Scheduling decisions: budgets, chunking, admission order, prefix hits, preemption and aborts."""

import pytest

from helpers.core_helpers import (
    FULL, check_all_free, check_invariants, fake_output, make_request, make_scheduler, run_to_completion, sliding,
)
from micro_vllm.core.request import RequestStatus
from micro_vllm.metrics.stats import PrefixCacheStats


def test_chunked_prefill_respects_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request(20, max_tokens=2)
    scheduler.add_request(request)
    chunks = []
    while request.num_output_tokens == 0:
        plan = scheduler.schedule()
        chunks.append(plan.num_scheduled_tokens[request.request_id])
        assert plan.total_num_scheduled_tokens <= 8
        scheduler.update_from_output(fake_output(plan, scheduler))
    assert chunks == [8, 8, 4]
    assert request.num_computed_tokens == 20 and request.num_tokens == 21


def test_decodes_and_prefill_chunks_share_a_step():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first = make_request(6, max_tokens=5)
    scheduler.add_request(first)
    plan = scheduler.schedule()
    scheduler.update_from_output(fake_output(plan, scheduler))
    second = make_request(30, max_tokens=5)
    scheduler.add_request(second)
    plan = scheduler.schedule()
    assert dict(plan.num_scheduled_tokens) == {first.request_id: 1, second.request_id: 9}
    assert [r.req_id for r in plan.scheduled_new_reqs] == [second.request_id]
    assert plan.scheduled_cached_reqs.req_ids == (first.request_id,)
    assert plan.scheduled_cached_reqs.num_computed_tokens == (6,)
    assert plan.scheduled_cached_reqs.new_block_ids == (None,)  # its 7th token fits its second block


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    requests = [make_request(5, max_tokens=3) for _ in range(4)]
    for r in requests:
        scheduler.add_request(r)
    plan = scheduler.schedule()
    assert list(plan.num_scheduled_tokens) == [requests[0].request_id, requests[1].request_id]
    scheduler.update_from_output(fake_output(plan, scheduler))

    def at_most_two_running(s, plan):
        assert len(s.running) <= 2 and len(plan.num_scheduled_tokens) <= 2

    finished = run_to_completion(scheduler, check=at_most_two_running)
    assert {r.request_id for r in finished} >= {r.request_id for r in requests[2:]}


def test_plan_is_immutable():
    scheduler = make_scheduler()
    scheduler.add_request(make_request(5))
    plan = scheduler.schedule()
    with pytest.raises(Exception):
        plan.total_num_scheduled_tokens = 3
    with pytest.raises(TypeError):
        plan.num_scheduled_tokens["x"] = 1


def test_all_blocks_free_after_all_requests_finish():
    scheduler = make_scheduler(num_blocks=40, max_num_batched_tokens=16)
    for n in (3, 17, 9, 30, 1):
        scheduler.add_request(make_request(n, max_tokens=6))
    finished = run_to_completion(scheduler)
    assert len(finished) == 5
    assert all(r.num_output_tokens == 6 and r.finish_reason == "length" for r in finished)
    check_all_free(scheduler)


def test_stop_conditions():
    scheduler = make_scheduler(max_model_len=12)
    eos = make_request(4, max_tokens=10)
    eos.sampling_params = eos.sampling_params.__class__(max_tokens=10)  # honours EOS (token 0 here)
    capped = make_request(8, max_tokens=100)
    stop = make_request(4, max_tokens=10, stop_token_ids=[5])
    for r in (eos, capped, stop):
        scheduler.add_request(r)
    plan = scheduler.schedule()
    outputs = {eos.request_id: [0], capped.request_id: [3], stop.request_id: [5]}
    from micro_vllm.outputs import ModelRunnerOutput
    finished = scheduler.update_from_output(ModelRunnerOutput(list(outputs), list(outputs.values())))
    assert {r.request_id: r.finish_reason for r in finished} == {eos.request_id: "stop", stop.request_id: "stop"}
    assert (eos.stop_reason, stop.stop_reason) == (None, 5)  # vLLM names the stop token, not EOS
    run_to_completion(scheduler)
    assert capped.finish_reason == "length" and capped.num_tokens == 12 and capped.stop_reason is None


def test_stop_tokens_end_requests_that_decode_together():
    """In a step in which every request decodes, each stops at its own stop token or EOS and the
    others go on (a stop id past int64, never sampled, is no trouble)."""
    scheduler = make_scheduler()
    stop = make_request(4, max_tokens=10, stop_token_ids=[2**70, 7])
    eos = make_request(4, max_tokens=10)
    eos.sampling_params = eos.sampling_params.__class__(max_tokens=10)  # honours EOS (token 0 here)
    other = make_request(4, max_tokens=10)
    for r in (stop, eos, other):
        scheduler.add_request(r)
    assert scheduler.update_from_output(fake_output(scheduler.schedule(), scheduler, token=3)) == []  # the prompts
    plan = scheduler.schedule()
    assert dict(plan.num_scheduled_tokens) == dict.fromkeys(scheduler.requests, 1)
    assert scheduler.update_from_output(fake_output(plan, scheduler, token=7)) == [stop]
    assert stop.stop_reason == 7 and stop.output_token_ids == [3, 7]
    assert scheduler.update_from_output(fake_output(scheduler.schedule(), scheduler, token=0)) == [eos]
    assert other.output_token_ids == [3, 7, 0] and not other.is_finished
    run_to_completion(scheduler)
    assert other.finish_reason == "length"
    check_all_free(scheduler)


def test_request_that_can_never_fit_is_refused():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="can never fit"):
        scheduler.add_request(make_request(10, max_tokens=40))
    scheduler.add_request(make_request(10, max_tokens=6))  # 16 tokens = 4 blocks fits


def test_prompt_that_leaves_no_room_under_max_model_len_is_refused():
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match=r"prompt of 16 tokens leaves no room.*max_model_len=16.*at most 15"):
        scheduler.add_request(make_request(16))
    assert not scheduler.requests
    scheduler.add_request(make_request(15))


def test_each_plan_comes_with_a_stats_snapshot():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    first = make_request(list(range(10)), max_tokens=3)
    scheduler.add_request(first)
    plan = scheduler.schedule()
    stats = scheduler.stats
    assert (stats.num_prefill_tokens, stats.num_decode_tokens, stats.decode_req_ids) == (10, 0, frozenset())
    assert stats.prefix_cache_stats == PrefixCacheStats(queries=10, hits=0)
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_preempted_reqs) == (1, 0, 0)
    assert (stats.kv_total_blocks, stats.kv_used_blocks, stats.kv_cached_blocks) == (63, 3, 2)
    assert stats.kv_cache_usage == 3 / 63
    scheduler.update_from_output(fake_output(plan, scheduler))
    second = make_request(list(range(10)) + [99], max_tokens=3)  # its first two blocks are cached
    scheduler.add_request(second)
    scheduler.add_request(make_request(4, max_tokens=3))
    plan = scheduler.schedule()
    assert scheduler.stats is not stats and stats.num_prefill_tokens == 10  # a frozen snapshot per plan
    stats = scheduler.stats
    assert stats.decode_req_ids == {first.request_id} and stats.num_decode_tokens == 1
    assert stats.num_prefill_tokens == 3 + 4 == plan.total_num_scheduled_tokens - 1
    assert stats.prefix_cache_stats == PrefixCacheStats(queries=11 + 4, hits=8)
    assert (stats.num_running_reqs, stats.kv_used_blocks) == (3, 3 + 1 + 1)  # the second shares two blocks
    between = scheduler.make_stats()  # between steps: the state, and no step's work
    assert (between.num_running_reqs, between.kv_free_blocks) == (3, stats.kv_free_blocks)
    assert between.prefix_cache_stats == PrefixCacheStats()
    assert between.num_prefill_tokens == between.num_decode_tokens == 0


def test_preemption_recomputes_and_finishes_everything():
    # Room for one request of 16 tokens at a time (4 blocks of 4), many requests.
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=16)
    requests = [make_request(list(range(i, i + 6)), max_tokens=10) for i in range(5)]
    for r in requests:
        scheduler.add_request(r)
    preempted = set()

    def check(s, plan):
        preempted.update(plan.preempted_req_ids)
        assert s.stats.num_preempted_reqs == len(plan.preempted_req_ids)
        kv = s.kv_cache_manager
        assert kv.num_free_blocks + sum(b.ref_cnt > 0 for b in kv.block_pool.blocks[1:]) == kv.num_usable_blocks

    finished = run_to_completion(scheduler, check=check)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    assert preempted, "this workload must preempt"
    assert all(r.num_output_tokens == 10 for r in finished)


def test_abort_frees_blocks_and_leaves_others():
    from micro_vllm.core.request import RequestStatus

    scheduler = make_scheduler()
    a, b = make_request(10, max_tokens=5), make_request(10, max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan = scheduler.schedule()
    scheduler.update_from_output(fake_output(plan, scheduler))
    scheduler.finish_requests([a.request_id], RequestStatus.FINISHED_ABORTED)
    assert a.finish_reason == "abort"
    plan = scheduler.schedule()
    assert plan.finished_req_ids == {a.request_id}
    scheduler.update_from_output(fake_output(plan, scheduler))
    run_to_completion(scheduler)
    assert b.num_output_tokens == 5
    check_all_free(scheduler)


def step(scheduler):
    plan = scheduler.schedule()
    scheduler.update_from_output(fake_output(plan, scheduler))
    check_invariants(scheduler)
    return plan


def test_request_arriving_mid_prefill_hits_the_first_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=12, block_size=4)
    first = make_request(list(range(20)), max_tokens=2)
    scheduler.add_request(first)
    assert dict(step(scheduler).num_scheduled_tokens) == {first.request_id: 12}  # blocks 1..3, cached
    second = make_request(list(range(12)) + [90, 91, 92, 93], max_tokens=2)
    scheduler.add_request(second)
    plan = step(scheduler)
    assert dict(plan.num_scheduled_tokens) == {first.request_id: 8, second.request_id: 4}
    assert plan.scheduled_cached_reqs.new_block_ids == (((4, 5),),)
    [new] = plan.scheduled_new_reqs
    assert new.block_ids == ((1, 2, 3, 6),) and new.num_computed_tokens == 12
    assert second.num_cached_tokens == 12


def test_full_hit_schedules_exactly_the_last_token():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request(list(range(12)) + [99], max_tokens=1))
    run_to_completion(scheduler)
    twin = make_request(list(range(12)) + [50], max_tokens=1)
    scheduler.add_request(twin)
    plan = step(scheduler)
    assert dict(plan.num_scheduled_tokens) == {twin.request_id: 1}
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 12 and twin.num_cached_tokens == 12


def test_preemption_takes_the_latest_request_and_resumes_it_first():
    # 4 usable blocks of 4 tokens: two 6-token prompts fit, but not once both pass 8 tokens.
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=16)
    first, second = make_request(list(range(6)), max_tokens=10), make_request(list(range(10, 16)), max_tokens=10)
    late = make_request(list(range(20, 23)), max_tokens=2)
    for request in (first, second):
        scheduler.add_request(request)
    step(scheduler)  # both prompts: blocks 1, 2 and 3, 4
    scheduler.add_request(late)  # no block left for it
    step(scheduler)
    step(scheduler)
    plan = step(scheduler)  # first's 9th token needs a third block: the latest admitted request gives its two back
    assert plan.preempted_req_ids == {second.request_id}
    assert dict(plan.num_scheduled_tokens) == {first.request_id: 1}
    assert plan.scheduled_cached_reqs.new_block_ids == (((4,),),)  # second's tail block, freed first
    assert [r.request_id for r in scheduler.waiting] == [second.request_id, late.request_id]
    assert second.num_preemptions == 1 and second.num_computed_tokens == 0
    assert second.num_output_tokens == 3  # kept, and recomputed with the prompt
    # It resumes before later arrivals, as a new request carrying its output so far. Its cached
    # blocks were evicted while first grew to four blocks, so it is recomputed from the start.
    while second.request_id not in (plan := step(scheduler)).num_scheduled_tokens:
        assert late.request_id not in plan.num_scheduled_tokens
    [resumed] = [r for r in plan.scheduled_new_reqs if r.req_id == second.request_id]
    assert list(resumed.token_ids) == list(range(10, 16)) + [7, 7, 7]
    assert resumed.num_computed_tokens == 0 and resumed.block_ids == ((3, 4, 2),)  # first's, tail first
    run_to_completion(scheduler, check=lambda s, p: check_invariants(s))
    assert [r.num_output_tokens for r in (first, second, late)] == [10, 10, 2]


def test_abort_of_waiting_and_preempted_requests():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=16, max_num_seqs=2)
    first, second, third = (make_request(list(range(i, i + 6)), max_tokens=10) for i in (0, 10, 20))
    for request in (first, second, third):
        scheduler.add_request(request)
    while not second.num_preemptions:
        step(scheduler)
    assert [r.request_id for r in scheduler.waiting] == [second.request_id, third.request_id]
    aborted = scheduler.finish_requests([second.request_id, third.request_id, "unknown"], RequestStatus.FINISHED_ABORTED)
    assert aborted == [second, third] and not scheduler.waiting
    check_invariants(scheduler)
    assert step(scheduler).finished_req_ids == {second.request_id, third.request_id}
    run_to_completion(scheduler)
    assert first.num_output_tokens == 10 and second.finish_reason == third.finish_reason == "abort"
    check_all_free(scheduler)


def test_sliding_window_runs_a_request_longer_than_the_cache():
    window_specs = (sliding(8),)
    # 100 tokens need 25 blocks under full attention, but a window of 8 with chunks of 16 needs 7.
    with pytest.raises(ValueError, match="can never fit"):
        make_scheduler(num_blocks=8, max_num_batched_tokens=16).add_request(make_request(20, max_tokens=80))
    # In a cache of 8 blocks (7 usable) it must run at all; in a roomy one the window must still
    # hold no more than 7 blocks at once (there, the bound is not the cache's size).
    for num_blocks in (8, 40):
        scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16, specs=window_specs)
        request = make_request(20, max_tokens=80)
        scheduler.add_request(request)
        peak = 0

        def check(s, plan):
            nonlocal peak
            check_invariants(s)
            kv = s.kv_cache_manager
            peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)

        run_to_completion(scheduler, check=check)
        assert request.num_output_tokens == 80 and peak <= 7


def test_sliding_window_steps_shrink_to_what_the_cache_holds():
    # With a budget of 64 one step would hold 7 + 64 tokens of a window of 8: 19 blocks of 4, more
    # than the 7 usable. Steps of 17 tokens hold at most cdiv(7 + 17, 4) + 1 = 7; 18 would need 8.
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=64, specs=(sliding(8),))
    request = make_request(60, max_tokens=40)
    assert scheduler.check_fits(request) == 17
    scheduler.add_request(request)
    steps = []

    def check(s, plan):
        check_invariants(s)
        steps.append(plan.total_num_scheduled_tokens)

    run_to_completion(scheduler, check=check)
    assert request.num_output_tokens == 40 and max(steps) == 17
    check_all_free(scheduler)
    # Room to spare: the whole budget.
    assert make_scheduler(num_blocks=40, max_num_batched_tokens=64, specs=(sliding(8),)).check_fits(request) == 64


@pytest.mark.parametrize("num_blocks, specs, enable_chunked_prefill", [
    (3, (sliding(8),), True),  # even a one-token step sees 8 keys: 3 blocks of 4
    (8, (sliding(8),), False),  # without chunking a prompt, or a resumed request, is one step
    (1 + 24 + 3, (FULL, sliding(8)), True),  # the full layers need all 25 blocks of 100 tokens
])
def test_request_whose_smallest_step_does_not_fit_is_refused(num_blocks, specs, enable_chunked_prefill):
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=128, specs=specs,
                               enable_chunked_prefill=enable_chunked_prefill)
    with pytest.raises(ValueError, match="can never fit"):
        scheduler.add_request(make_request(60, max_tokens=40))
    assert not scheduler.requests


def test_mixed_model_steps_shrink_for_the_window_group_only():
    scheduler = make_scheduler(num_blocks=1 + 25 + 7, max_num_batched_tokens=128, specs=(FULL, sliding(8)))
    request = make_request(60, max_tokens=40)
    scheduler.add_request(request)  # 25 blocks for the full layers, 7 for the window in steps of 17
    assert request.max_chunk_tokens == 17
    run_to_completion(scheduler, check=lambda s, plan: check_invariants(s))
    assert request.num_output_tokens == 40
    check_all_free(scheduler)


def test_async_scheduling_plans_ahead_and_drops_the_token_after_a_stop():
    """The next plan is made before the last step's tokens are back: each request counts the token
    in flight as a placeholder, a request whose last allowed token is in flight is not planned
    again, and a token sampled after a stop is dropped."""
    from micro_vllm.outputs import ModelRunnerOutput

    scheduler = make_scheduler()
    capped = make_request(4, max_tokens=3)
    stopping = make_request(4, max_tokens=10, stop_token_ids=[5])
    for r in (capped, stopping):
        scheduler.add_request(r)
    first = scheduler.schedule()
    assert capped.num_computed_tokens == 4 and capped.num_output_placeholders == 1
    second = scheduler.schedule()  # planned before `first` returns: each decodes its token in flight
    assert dict(second.num_scheduled_tokens) == {capped.request_id: 1, stopping.request_id: 1}
    assert capped.num_output_placeholders == 2

    def returns(tokens):
        return scheduler.update_from_output(ModelRunnerOutput(list(tokens), [[t] for t in tokens.values()]))

    assert returns({capped.request_id: 3, stopping.request_id: 5}) == [stopping]
    third = scheduler.schedule()
    assert third.finished_req_ids == {stopping.request_id}
    assert dict(third.num_scheduled_tokens) == {capped.request_id: 1}
    assert returns({capped.request_id: 3, stopping.request_id: 9}) == []
    assert stopping.output_token_ids == [5]  # the token planned after the stop is dropped
    assert scheduler.schedule().is_empty  # capped's third and last token is in flight
    assert returns({capped.request_id: 3}) == [capped]
    assert capped.output_token_ids == [3, 3, 3] and capped.finish_reason == "length"
    check_all_free(scheduler)


def test_decode_steps_list_the_running_requests_and_their_decodes():
    """Steps in which the same running requests all decode list them all, in the plan and as the
    stats' decodes; a finish or an admission changes them at once, and earlier plans stay as they were."""
    scheduler = make_scheduler(max_num_batched_tokens=64)
    short, long = make_request(4, max_tokens=3), make_request(4, max_tokens=6)
    for r in (short, long):
        scheduler.add_request(r)

    def step():
        plan = scheduler.schedule()
        stats = scheduler.stats
        scheduler.update_from_output(fake_output(plan, scheduler))
        return plan, stats

    step()  # both prompts
    (second, second_stats), (third, third_stats) = step(), step()  # both decode; short's third token ends it
    both = {short.request_id: 1, long.request_id: 1}
    assert dict(second.num_scheduled_tokens) == dict(third.num_scheduled_tokens) == both
    assert third.scheduled_cached_reqs.req_ids == second.scheduled_cached_reqs.req_ids == tuple(both)
    assert third_stats.decode_req_ids == second_stats.decode_req_ids == set(both)
    fourth, fourth_stats = step()
    assert dict(fourth.num_scheduled_tokens) == {long.request_id: 1}
    assert fourth.scheduled_cached_reqs.req_ids == (long.request_id,)
    assert fourth_stats.decode_req_ids == {long.request_id} and fourth_stats.num_decode_tokens == 1
    newcomer = make_request(list(range(10, 15)))
    scheduler.add_request(newcomer)
    fifth, fifth_stats = step()  # long decodes, the newcomer's prompt joins after it
    assert list(fifth.num_scheduled_tokens.items()) == [(long.request_id, 1), (newcomer.request_id, 5)]
    assert fifth.scheduled_cached_reqs.req_ids == (long.request_id,)
    assert fifth_stats.decode_req_ids == {long.request_id} and fifth_stats.num_prefill_tokens == 5
    sixth, sixth_stats = step()
    assert dict(sixth.num_scheduled_tokens) == {long.request_id: 1, newcomer.request_id: 1}
    assert sixth_stats.decode_req_ids == {long.request_id, newcomer.request_id}
    assert dict(fourth.num_scheduled_tokens) == {long.request_id: 1}  # an earlier plan is left as it was


def new_token_ids(plan) -> dict[str, tuple[int, ...]]:
    cached = plan.scheduled_cached_reqs
    return dict(zip(cached.req_ids, cached.new_token_ids, strict=True))


def test_plans_carry_each_applied_token_once_sync():
    """``new_token_ids``: the token a step sampled comes with the next plan, once; a prompt chunk
    brings none, and a request joining the batch brings its tokens whole."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    long, short = make_request(12, max_tokens=3), make_request(4, max_tokens=3)
    for r in (long, short):
        scheduler.add_request(r)
    plan = scheduler.schedule()  # long's first chunk of 8; no budget left for short
    assert new_token_ids(plan) == {} and [new.req_id for new in plan.scheduled_new_reqs] == [long.request_id]
    scheduler.update_from_output(fake_output(plan, scheduler, token=3))  # a chunk samples nothing
    plan = scheduler.schedule()
    assert new_token_ids(plan) == {long.request_id: ()}
    assert [new.token_ids for new in plan.scheduled_new_reqs] == [tuple(range(4))]
    scheduler.update_from_output(fake_output(plan, scheduler, token=5))
    plan = scheduler.schedule()
    assert new_token_ids(plan) == {long.request_id: (5,), short.request_id: (5,)}
    scheduler.update_from_output(fake_output(plan, scheduler, token=6))
    assert new_token_ids(scheduler.schedule()) == {long.request_id: (6,), short.request_id: (6,)}


def test_plans_carry_each_applied_token_once_async():
    """Planned before the last step's token is back, a plan carries nothing for it; the next plan
    that lists the request carries every token applied since, in order, and only once."""
    from micro_vllm.outputs import ModelRunnerOutput

    scheduler = make_scheduler()
    request = make_request(4, max_tokens=6)
    scheduler.add_request(request)
    rid = request.request_id

    def returns(token):
        scheduler.update_from_output(ModelRunnerOutput([rid], [[token]]))

    assert [new.req_id for new in scheduler.schedule().scheduled_new_reqs] == [rid]
    assert new_token_ids(scheduler.schedule()) == {rid: ()}  # the first token is still in flight
    returns(7)
    assert new_token_ids(scheduler.schedule()) == {rid: (7,)}
    returns(8)
    returns(9)  # two steps' tokens applied before the next plan
    assert new_token_ids(scheduler.schedule()) == {rid: (8, 9)}
    assert new_token_ids(scheduler.schedule()) == {rid: ()}
    assert request.output_token_ids == [7, 8, 9]


def test_resumed_request_brings_every_token_and_later_plans_only_new_ones():
    """Preempted while its token is in flight (async), a request gets that token while it waits; it
    resumes as a new request with all its tokens, and later plans carry only what comes after."""
    from helpers.core_helpers import FakeRunner

    # 4 usable blocks of 4 tokens: two 6-token prompts fit, but not once both pass 8 tokens.
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=16)
    first, second = make_request(list(range(6)), max_tokens=10), make_request(list(range(10, 16)), max_tokens=10)
    for r in (first, second):
        scheduler.add_request(r)
    runner = FakeRunner(scheduler)  # it checks every plan's tokens against the scheduler's
    in_flight, plans = [], []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        plans.append(plan)
        in_flight.append(runner.execute(plan))
        if second.request_id in plan.preempted_req_ids:
            assert second.num_output_placeholders == 1  # its last step's token is in flight
            num_tokens = second.num_tokens
        while len(in_flight) > 1 or (in_flight and not scheduler.has_unfinished_requests()):
            scheduler.update_from_output(in_flight.pop(0))
            check_invariants(scheduler)
    [resumed_at] = [i for i, p in enumerate(plans) if second.request_id in {n.req_id for n in p.scheduled_new_reqs}][1:]
    [resumed] = [n for n in plans[resumed_at].scheduled_new_reqs if n.req_id == second.request_id]
    assert len(resumed.token_ids) == num_tokens + 1  # with the token that came back while it waited
    assert list(resumed.token_ids) == second.all_token_ids[: len(resumed.token_ids)]
    # Each later plan carries the token applied since the one before; the first comes before the
    # resumed step's token, and the last, planned while the request's last token is in flight, no
    # longer lists it: the last two tokens, which the runner sampled itself, are never carried.
    later = [new_token_ids(p).get(second.request_id) for p in plans[resumed_at + 1 :]]
    assert later == [()] + [(t,) for t in second.all_token_ids[len(resumed.token_ids) : -2]] + [None]
    assert first.num_output_tokens == second.num_output_tokens == 10
