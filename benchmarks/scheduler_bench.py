"""CPU cost of one scheduler step: Scheduler + KVCacheManager alone, no model, a fake runner.

Every GPU step waits for ``schedule()`` before it can start and for ``update_from_output()`` before
the next one, so their CPU time is on the critical path. This drives them over the throughput
recipe's workload (docs/benchmarks.md, /work/shared/benchmarks.md): 256 requests, prompts and
outputs of randint(100, 1024) tokens drawn after ``random.seed(0)``, all added at once, block size
16, 8192 batched tokens and 256 sequences per step, and enough blocks for every request at once.
The fake runner samples one token for every request whose known tokens are all computed.

    python benchmarks/scheduler_bench.py [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from dataclasses import dataclass

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.config import SchedulerConfig
from micro_vllm.core.kv_cache_manager import KVCacheManager, make_kv_cache_groups
from micro_vllm.core.request import Request
from micro_vllm.core.scheduler import Scheduler
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.outputs import ModelRunnerOutput
from micro_vllm.sampling.params import SamplingParams

NUM_REQUESTS = 256
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
# Qwen3-0.6B's shape; the scheduler only groups layers by spec, so one full-attention group.
SPEC = AttentionSpec(num_kv_heads=8, head_size=128)


@dataclass
class StepTimes:
    schedule_ns: list[int]
    update_ns: list[int]
    num_scheduled_requests: int = 0  # summed over steps


def make_workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """The recipe's prompts and output lengths, drawn in the recipe's order."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(NUM_REQUESTS)]
    max_tokens = [rng.randint(100, 1024) for _ in range(NUM_REQUESTS)]
    return list(zip(prompts, max_tokens))


def make_scheduler(workload: list[tuple[list[int], int]], enable_caching: bool) -> Scheduler:
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8192, max_num_seqs=256)
    num_blocks = 1 + sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in workload)  # + the null block
    kv = KVCacheManager(make_kv_cache_groups([SPEC]), num_blocks, BLOCK_SIZE, enable_caching)
    return Scheduler(config, MAX_MODEL_LEN, kv)


def fake_runner(plan: SchedulerOutput, scheduler: Scheduler, next_token: int) -> ModelRunnerOutput:
    """One token for each request whose known tokens are all computed after this step: those the
    plan counts an output placeholder for (no other step is in flight here)."""
    requests = scheduler.requests
    req_ids = list(plan.num_scheduled_tokens)
    sampled = [[next_token] if requests[req_id].num_output_placeholders else [] for req_id in req_ids]
    return ModelRunnerOutput(req_ids, sampled)


def run_once(workload: list[tuple[list[int], int]], enable_caching: bool) -> StepTimes:
    scheduler = make_scheduler(workload, enable_caching)
    for i, (prompt, max_tokens) in enumerate(workload):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.6, ignore_eos=True)
        scheduler.add_request(Request(str(i), prompt, params, arrival_time=float(i)))
    times = StepTimes([], [])
    clock = time.perf_counter_ns
    step = 0
    while scheduler.has_unfinished_requests():
        start = clock()
        plan = scheduler.schedule()
        scheduled = clock()
        output = fake_runner(plan, scheduler, next_token=step % 10000)
        ready = clock()
        scheduler.update_from_output(output)
        done = clock()
        times.schedule_ns.append(scheduled - start)
        times.update_ns.append(done - ready)
        times.num_scheduled_requests += len(plan.num_scheduled_tokens)
        step += 1
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    return times


def summarize(name: str, samples_ns: list[int]) -> str:
    us = sorted(s / 1000 for s in samples_ns)
    p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
    return (f"{name:<20} mean {statistics.fmean(us):8.1f} us   median {statistics.median(us):8.1f} us   "
            f"p99 {p99:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs; the figures are of the median run")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one run instead")
    args = parser.parse_args()
    workload = make_workload()
    caching = not args.no_prefix_caching
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(run_once, workload, caching)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    runs = [run_once(workload, caching) for _ in range(args.repeats)]
    # The run whose total scheduler time is the median stands for all: shared machines drift.
    runs.sort(key=lambda t: sum(t.schedule_ns) + sum(t.update_ns))
    median_run = runs[len(runs) // 2]
    total_s = [(sum(t.schedule_ns) + sum(t.update_ns)) / 1e9 for t in runs]
    print(f"{NUM_REQUESTS} requests, {len(median_run.schedule_ns)} steps, prefix caching "
          f"{'on' if caching else 'off'}, {args.repeats} runs (median run shown)")
    print(summarize("schedule()", median_run.schedule_ns))
    print(summarize("update_from_output()", median_run.update_ns))
    step_ns = [a + b for a, b in zip(median_run.schedule_ns, median_run.update_ns)]
    print(summarize("step (both)", step_ns))
    print(f"per scheduled request and step: {sum(step_ns) / median_run.num_scheduled_requests / 1000:.2f} us")
    print(f"scheduler seconds per run: {', '.join(f'{s:.3f}' for s in sorted(total_s))}")


if __name__ == "__main__":
    main()
