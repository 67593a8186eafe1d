"""The benchmark scripts' own logic on CPU, so a change to the engine cannot silently break them
(they run only on request, mostly on the GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from micro_vllm import LLM
from micro_vllm.worker.model_runner import AsyncModelRunnerOutput
from tiny_models import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import scheduler_bench  # noqa: E402
import throughput  # noqa: E402


@pytest.mark.parametrize("enable_caching", [True, False])
def test_scheduler_bench_runs_a_workload_to_the_end(enable_caching):
    workload = [(list(range(1 + i, 40 + 7 * i)), 5 + i) for i in range(12)]
    times = scheduler_bench.run_once(workload, enable_caching)
    assert len(times.schedule_ns) == len(times.update_ns) >= max(n for _, n in workload)
    assert times.num_scheduled_requests >= sum(n for _, n in workload)


def test_throughput_phase_timers_count_every_step_and_unwrap(tmp_path):
    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [[1 + i] * (5 + 9 * i) for i in range(6)]
    max_tokens = [3 + 2 * i for i in range(6)]
    with throughput.time_phases(llm) as phases:
        tokens, _ = throughput.run_micro_vllm(llm, prompts, max_tokens, temperature=0.6)
    assert tokens == sum(max_tokens)
    steps = phases["step_calls"]
    assert steps > 0 and all(phases[name + "_calls"] == steps for name in ("schedule", "execute"))
    assert sum(phases[kind + "_calls"] for kind in throughput.STEP_KINDS) == steps
    assert phases["with prefill_calls"] > 0 and phases["decodes 1-15_calls"] > 0
    engine = llm.engine
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler)  # unwrapped
    assert AsyncModelRunnerOutput.get_output.__qualname__ == "AsyncModelRunnerOutput.get_output"


def test_results_table_has_a_row_per_measurement():
    import json

    import results_table

    throughput_line = json.dumps({
        "benchmark": "throughput", "enforce_eager": False, "no_fused_ops": True,
        "runs": [{"tok_per_s": 14279, "output_tokens": 133966, "seconds": 9.382, "steps": 1033}],
        "compare_transformers": {"requests": 16, "output_tokens": 2048, "seconds": 14.654},
    })
    latency_line = json.dumps({"benchmark": "latency", "prompt_len": 512, "output_len": 128,
                               "rows": [{"batch_size": 1, "ttft_ms": 17.8, "tpot_ms": 1.791}]})
    table = results_table.results_table([throughput_line, latency_line]).splitlines()
    assert table[2] == "| throughput | --no-fused-ops | 14,279 output tok/s (133,966 tokens in 9.382 s, 1,033 steps) |"
    assert table[3].startswith("| transformers, 16 requests | same process | 140 output tok/s")
    assert table[4] == "| latency | batch 1, prompt 512, output 128 | TTFT 17.8 ms, TPOT 1.79 ms |"
    assert len(table) == 5
