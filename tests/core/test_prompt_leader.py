"""Requests that share a prompt (the sequences of a parallel-sampling request): the scheduler admits
the followers only once their leader's prompt is planned, so the prompt is computed once."""

from __future__ import annotations

import pytest

from helpers.core_helpers import FULL, FakeRunner, check_all_free, make_request, make_scheduler, sliding

PROMPT = list(range(1, 31))  # 7 full blocks of 4 and 2 tokens


def siblings(n: int, prompt=PROMPT, max_tokens=3):
    requests = [make_request(prompt, max_tokens=max_tokens, request_id=f"{i}_p") for i in range(n)]
    for request in requests[1:]:
        request.prompt_leader = requests[0]
    return requests


def run(scheduler, requests, async_scheduling=False) -> int:
    """Run ``requests`` to the end; return the prompt tokens computed (every step's prefill)."""
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler, async_scheduling=async_scheduling)
    prefill = 0
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            check_all_free(scheduler)
            return prefill
        runner.step()
        prefill += scheduler.stats.num_prefill_tokens
    raise AssertionError("the requests did not finish")


def tail(prompt_len: int, block_size: int) -> int:
    """What a follower computes itself: the tokens after the full blocks a hit can cover (never the
    last token)."""
    return prompt_len - (prompt_len - 1) // block_size * block_size


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("specs, num_blocks, budget", [
    ((FULL,), 64, 16),  # budget-sized chunks: a follower has no budget before the leader's last chunk
    # A cache too small for larger steps of the window: the leader's first chunk (21 tokens) leaves
    # budget, and a follower admitted beside it would compute again what the leader computes next.
    ((sliding(4),), 8, 24),
])
def test_followers_wait_for_the_leaders_prompt(specs, num_blocks, budget, async_scheduling):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, specs=specs)
    requests = siblings(3)
    assert run(scheduler, requests, async_scheduling) == len(PROMPT) + 2 * tail(len(PROMPT), 4)
    assert all(r.num_cached_tokens == (0 if r is requests[0] else 28) for r in requests)


def test_without_prefix_caching_each_computes_its_prompt():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=16, enable_caching=False)
    assert run(scheduler, siblings(3)) == 3 * len(PROMPT)
