"""The workload of the fault and thread tests: prompts with shared prefixes on a cache small enough
to preempt, a fresh engine's tokens for them, and how to build the engine."""

from __future__ import annotations

import pytest

from helpers.core_helpers import token_ids
from helpers.tiny_models import make_tiny_model
from micro_vllm import LLM, SamplingParams

FAMILY = "qwen3_sliding"  # two KV cache groups, one of them a sliding window
SHARED = [(i * 53 + 7) % 250 for i in range(14)]
# Shared prefixes (hits within a call and across calls), lengths that cross block boundaries.
PROMPTS = [SHARED + [1, 2, 3], SHARED + [9], SHARED[:9], [(i * 31) % 250 for i in range(19)], SHARED + [1, 2, 3, 4]]
PARAMS = [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop="t"),  # detokenized each step; stops at 8
    SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
]
# A cache of 14 usable blocks of 4 cannot hold all five requests at once: they preempt each other.
SETTINGS = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=15)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(FAMILY, tmp_path_factory.mktemp("models"))


def make_llm(path, **overrides) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", attention_backend="sdpa", **{**SETTINGS, **overrides})


def record_preemptions(llm: LLM) -> list[str]:
    """The ids of the requests the engine's scheduler preempts from now on, as they happen."""
    preempted: list[str] = []
    schedule = llm.engine.scheduler.schedule

    def logged_schedule():
        plan = schedule()
        preempted.extend(plan.preempted_req_ids)
        return plan

    llm.engine.scheduler.schedule = logged_schedule
    return preempted


@pytest.fixture(scope="module")
def expected(model_dir):
    """A fresh engine's tokens for PROMPTS; the run must preempt for the tests to mean anything."""
    llm = make_llm(model_dir)
    preempted = record_preemptions(llm)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert preempted, "the cache must be small enough to preempt"
    return token_ids(outputs)
