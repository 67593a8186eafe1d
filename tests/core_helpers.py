"""Builders for CPU-only core tests: requests, a scheduler over a KV cache, and a fake runner."""

from __future__ import annotations

import itertools

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.config import SchedulerConfig
from micro_vllm.core.kv_cache_manager import KVCacheManager, make_kv_cache_groups
from micro_vllm.core.request import Request
from micro_vllm.core.scheduler import Scheduler
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.outputs import ModelRunnerOutput
from micro_vllm.sampling.params import SamplingParams

FULL = AttentionSpec(num_kv_heads=2, head_size=8)
_ids = itertools.count()


def make_request(prompt, max_tokens=4, request_id=None, **params) -> Request:
    prompt = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
    rid = request_id if request_id is not None else f"r{next(_ids)}"
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), frozenset({0}))


def make_kv_manager(num_blocks=16, block_size=4, specs=(FULL,), enable_caching=True) -> KVCacheManager:
    return KVCacheManager(make_kv_cache_groups(list(specs)), num_blocks, block_size, enable_caching)


def make_scheduler(
    num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
    specs=(FULL,), enable_caching=True, enable_chunked_prefill=True,
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
    )
    return Scheduler(config, max_model_len, make_kv_manager(num_blocks, block_size, specs, enable_caching))


def fake_output(plan: SchedulerOutput, scheduler: Scheduler, token=7) -> ModelRunnerOutput:
    """Sample ``token`` for every request whose known tokens are all computed after this step."""
    req_ids = list(plan.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        request = scheduler.requests[rid]
        done = request.num_computed_tokens + plan.num_scheduled_tokens[rid] == request.num_tokens
        sampled.append([token] if done else [])
    return ModelRunnerOutput(req_ids, sampled)


def run_to_completion(scheduler: Scheduler, max_steps=10_000, check=None) -> list[Request]:
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        plan = scheduler.schedule()
        finished += scheduler.update_from_output(plan, fake_output(plan, scheduler))
        if check is not None:
            check(scheduler, plan)
    raise AssertionError("requests did not finish: the scheduler made no progress")
