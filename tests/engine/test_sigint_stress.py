"""Thousands of real SIGINTs at random moments of a loop of ``generate`` calls, in a child process:
each one surfaces as a KeyboardInterrupt (none hangs, none is lost), none leaves anything behind,
every call after gives a fresh engine's tokens, and together they land in every phase of a call.

Long, so not in the default run: it runs only when MICRO_VLLM_SIGINT_STRESS gives the number of
SIGINTs, for example (docs/architecture.md, section 5, has a result)::

    MICRO_VLLM_SIGINT_STRESS=3000 python -m pytest -q -s tests/engine/test_sigint_stress.py
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest

from helpers.fault_workload import SigintChild, model_dir  # noqa: F401  (a fixture)

NUM_INTERRUPTS = int(os.environ.get("MICRO_VLLM_SIGINT_STRESS", "0"))

# Where an interrupt landed: the innermost frame of micro_vllm it left, by module (path under the
# package) or by module and function; "-" is the child's own loop, between two calls.
PHASES = {
    "llm.py:_as_prompt_list": "validation",
    "llm.py:_as_params_list": "validation",
    "llm.py:_final_only": "validation",
    "llm.py:get_default_sampling_params": "validation",
    "sampling/params.py": "validation",
    "validation.py": "validation",
    "engine/engine.py:make_request": "validation",
    "engine/engine.py:_check_vocabulary": "validation",
    "engine/engine.py:_check_num_logprobs": "validation",
    "engine/engine.py:_token_ids": "validation",
    "engine/engine.py:add_request": "validation",
    "engine/engine.py:_tokenize": "tokenization",
    "tokenizer.py": "tokenization",
    "core/": "scheduling",
    "worker/": "input preparation",
    "executor/": "input preparation",
    "cpu_gpu_buffer.py": "input preparation",
    "worker/model_runner.py:run_model": "forward pass",
    "models/": "forward pass",
    "layers/": "forward pass",
    "attention/": "forward pass",
    "worker/model_runner.py:compute_logits": "sampling",
    "worker/model_runner.py:sample": "sampling",
    "worker/step_output.py": "sampling",
    "sampling/": "sampling",
    "engine/detokenizer.py": "detokenization",
    "engine/output_processor.py": "output building",
    "engine/request_output.py": "output building",
    "engine/parallel_sampling.py": "output building",
    "engine/logprobs.py": "output building",
    "llm.py": "the generate loop",
    "engine/engine.py": "the engine's step",
    "-": "between calls",
}
REQUIRED = {"validation", "tokenization", "scheduling", "input preparation", "forward pass", "sampling",
            "detokenization", "output building"}


def phase_of(where: str) -> str:
    """The phase of ``PHASES`` whose key matches ``where`` most closely (module and function, then
    module, then folder)."""
    path = where.split(":")[0]
    for key in (where, path, path.split("/")[0] + "/"):
        if key in PHASES:
            return PHASES[key]
    return where


@pytest.mark.skipif(not NUM_INTERRUPTS, reason="set MICRO_VLLM_SIGINT_STRESS to the number of SIGINTs to send")
def test_thousands_of_sigints_in_every_phase_of_generate(model_dir, tmp_path):  # noqa: F811
    child = SigintChild(model_dir, "every_phase", NUM_INTERRUPTS, tmp_path / "child_stderr.txt")
    rng = random.Random(0)
    phases = Counter()
    start = time.monotonic()
    try:
        for sent in range(1, NUM_INTERRUPTS + 1):
            # Half of the delays spread evenly over a call, half evenly over the decades from 10 us
            # to a call: the short phases at the start of a call get their share of interrupts too.
            call = child.call_seconds
            time.sleep(rng.uniform(0, 1.2 * call) if rng.random() < 0.5 else call * 10 ** rng.uniform(-4, 0))
            phases[phase_of(child.interrupt())] += 1
            if sent % 250 == 0:  # progress, for a long run (with -s)
                print(f"\n{sent} SIGINTs in {time.monotonic() - start:.0f} s: {dict(phases.most_common())}", flush=True)
        result = child.result()
    finally:
        child.close()
    print(f"\n{NUM_INTERRUPTS} SIGINTs in {time.monotonic() - start:.0f} s (a call took {child.call_seconds:.3f} s); "
          f"{result['completed']} calls completed between them; where they landed: {dict(phases.most_common())}")
    assert result["mismatches"] == 0 and result["left_behind"] == []
    assert result["hits"] > 0  # the prefix cache still serves what completed steps computed
    assert REQUIRED <= set(phases), f"no interrupt landed in {REQUIRED - set(phases)}"
