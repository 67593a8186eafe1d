"""Host time of one engine step: the scheduler's plan, the runner's preparation of its inputs, and
applying its sampled tokens, without the model.

Every GPU step waits for ``Scheduler.schedule()`` and for the runner to stage its inputs
(``ModelRunner.execute_model`` up to the forward pass), and the next step waits for the sampled
tokens to be applied (``get_output`` and ``Scheduler.update_from_output()``), so this CPU time is
on the critical path. The real Scheduler, KVCacheManager and ModelRunner run on the CPU as the
Engine drives them (async scheduling: one step in flight), over the throughput recipe's workload
(docs/benchmarks.md, "Host time of a step"): 256 requests, prompts and outputs of randint(100, 1024) tokens drawn after
``random.seed(0)``, all added at once, block size 16, 8192 batched tokens and 256 sequences per step,
and enough blocks for every request at once. The runner holds a tiny random model
(tests/helpers/tiny_models.py) with the GPU's defaults (the triton attention backend, the Triton
sampler); the forward pass and the sampler's kernel are skipped, and every sampling request draws
the same token.

    python benchmarks/scheduler_bench.py [--repeats 5] [--no-prefix-caching] [--cpu-time] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.tiny_models import make_tiny_model  # noqa: E402

from micro_vllm.config import SchedulerConfig  # noqa: E402
from micro_vllm.core.kv_cache_manager import KVCacheManager, make_kv_cache_groups  # noqa: E402
from micro_vllm.core.request import Request  # noqa: E402
from micro_vllm.core.scheduler import Scheduler  # noqa: E402
from micro_vllm.model_loader.checkpoint import load_hf_config  # noqa: E402
from micro_vllm.sampling.params import SamplingParams  # noqa: E402
from micro_vllm.sampling.sampler import SamplerOutput  # noqa: E402
from micro_vllm.worker.model_runner import ModelRunner, RunnerSettings, StepInputs  # noqa: E402

NUM_REQUESTS = 256
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
MAX_NUM_BATCHED_TOKENS = 8192


class HostOnlyRunner(ModelRunner):
    """The runner's host work as it is; the forward pass is skipped and every request draws
    ``next_token``."""

    next_token = 0

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        return torch.empty(0)

    def sample(self, hidden_states: torch.Tensor, inputs: StepInputs) -> SamplerOutput:
        return SamplerOutput(torch.full((inputs.num_reqs,), self.next_token, dtype=torch.int64), None)


@dataclass
class StepTimes:
    schedule_ns: list[int] = field(default_factory=list)
    prepare_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    full_decode: list[bool] = field(default_factory=list)  # the step decodes every request of the workload
    prefill: list[bool] = field(default_factory=list)  # the step computes prompt tokens

    @property
    def total_ns(self) -> int:
        return sum(self.schedule_ns) + sum(self.prepare_ns) + sum(self.update_ns)


def make_workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """The recipe's prompts and output lengths, drawn in the recipe's order."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(NUM_REQUESTS)]
    max_tokens = [rng.randint(100, 1024) for _ in range(NUM_REQUESTS)]
    return list(zip(prompts, max_tokens))


def make_runner(model_path: Path) -> HostOnlyRunner:
    """A runner as on a GPU, on the CPU: the triton attention backend's metadata and the Triton
    sampler's seeds are what a GPU step stages."""
    settings = RunnerSettings(
        device=torch.device("cpu"), dtype=torch.float32, kv_cache_dtype=torch.float32, attention_backend="triton",
        custom_ops=frozenset({"sampler"}),
        max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        block_size=BLOCK_SIZE, seed=0, use_cuda_graphs=False,
    )
    return HostOnlyRunner(settings, model_path, load_hf_config(model_path))


def run_once(workload: list[tuple[list[int], int]], enable_caching: bool, model_path: Path,
             clock=time.perf_counter_ns) -> StepTimes:
    runner = make_runner(model_path)
    groups = make_kv_cache_groups(runner.get_attention_specs())
    # The runner's K/V tensors are never read: one block each is enough.
    num_blocks = 1 + sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in workload)  # + the null block
    runner.initialize_kv_cache(groups, 2)
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                             max_num_seqs=NUM_REQUESTS)
    scheduler = Scheduler(config, MAX_MODEL_LEN, KVCacheManager(groups, num_blocks, BLOCK_SIZE, enable_caching))
    for i, (prompt, max_tokens) in enumerate(workload):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.6, ignore_eos=True)
        scheduler.add_request(Request(str(i), prompt, params, arrival_time=float(i)))
    times = StepTimes()
    in_flight = deque()
    step = 0
    while scheduler.has_unfinished_requests():
        runner.next_token = step % 10000
        start = clock()
        plan = scheduler.schedule()
        scheduled = clock()
        in_flight.append(runner.execute_model(plan))
        prepared = clock()
        # As Engine._execute: the step just launched stays in flight while requests are left.
        keep = 0 if plan.is_empty else 1
        while in_flight and (len(in_flight) > keep or not scheduler.has_unfinished_requests()):
            scheduler.update_from_output(in_flight.popleft().get_output())
        done = clock()
        times.schedule_ns.append(scheduled - start)
        times.prepare_ns.append(prepared - scheduled)
        times.update_ns.append(done - prepared)
        num_reqs = len(plan.num_scheduled_tokens)
        times.full_decode.append(num_reqs == len(workload) == plan.total_num_scheduled_tokens
                                 and not plan.scheduled_new_reqs)
        times.prefill.append(plan.total_num_scheduled_tokens > num_reqs or bool(plan.scheduled_new_reqs))
        step += 1
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    return times


def summarize(name: str, samples_ns: list[int]) -> str:
    if not samples_ns:
        return f"{name:<26} (no steps)"
    us = sorted(s / 1000 for s in samples_ns)
    p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
    return (f"{name:<26} fastest {us[0]:8.1f} us   mean {statistics.fmean(us):8.1f} us   "
            f"median {statistics.median(us):8.1f} us   p99 {p99:8.1f} us")


def report(times: StepTimes, num_requests: int) -> None:
    step_ns = [a + b + c for a, b, c in zip(times.schedule_ns, times.prepare_ns, times.update_ns)]
    columns = {"schedule": times.schedule_ns, "prepare": times.prepare_ns, "update": times.update_ns,
               "step (sum)": step_ns}
    kinds = {"all steps": [True] * len(step_ns), f"{num_requests} decodes": times.full_decode,
             "prefill steps": times.prefill}
    for kind, selected in kinds.items():
        print(f"{kind}: {sum(selected)} steps")
        for name, samples in columns.items():
            print("  " + summarize(name, [s for s, keep in zip(samples, selected) if keep]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs; the figures are of the median run")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one run instead")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time this thread's CPU time, not wall-clock time: steadier on a busy machine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = make_workload()
    caching = not args.no_prefix_caching
    with tempfile.TemporaryDirectory() as tmp:
        model_path = make_tiny_model("qwen3", Path(tmp))
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(run_once, workload, caching, model_path)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            return
        clock = time.thread_time_ns if args.cpu_time else time.perf_counter_ns
        runs = [run_once(workload, caching, model_path, clock) for _ in range(args.repeats)]
    # The run whose total host time is the median stands for all: shared machines drift.
    runs.sort(key=lambda t: t.total_ns)
    median_run = runs[len(runs) // 2]
    print(f"{NUM_REQUESTS} requests, {len(median_run.schedule_ns)} steps, prefix caching "
          f"{'on' if caching else 'off'}, {args.repeats} runs (median run shown), "
          f"{'CPU' if args.cpu_time else 'wall-clock'} time")
    report(median_run, len(workload))
    print(f"host seconds per run: {', '.join(f'{t.total_ns / 1e9:.3f}' for t in runs)}")


if __name__ == "__main__":
    main()
