"""Time to first token and time per output token at batch sizes 1, 8 and 64.

    python benchmarks/latency.py [--model DIR] [--prompt-len 512] [--output-len 128] [--repeat N] [--profile [BATCH]]

All requests of a batch arrive at once; TTFT is measured from their arrival to the step that
produced their first token, TPOT over the rest of their tokens. Figures are medians over the batch.
The first run of the batch sizes is the one compared with vLLM's (docs/benchmarks.md, "Latency");
``--repeat`` runs them again on other prompts (none served from the prefix cache), which shows whether
the first steps of a process are slower than later ones. Each run also prints the wall time of its first
steps (``LLMEngine.step``; with async scheduling a step returns before its own GPU work is done) and, on
CUDA, how many device (``cudaMalloc``) and pinned host (``cudaHostAlloc``) allocations the caching
allocators made during it: either waits for the GPU.
``--profile`` then shows where a batch's time goes (one request unless BATCH is given): the kernels of
its prefill step and of 20 of its decode steps (torch.profiler), each with the GPU's busy time against
the steps' wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from bench_model import build_random_model
from throughput import gpu_busy, sync
from workloads import (LATENCY_BATCH_SIZES, LATENCY_MAX_MODEL_LEN, LATENCY_OUTPUT_LEN, LATENCY_PROMPT_LEN,
                       MAX_TOKEN_ID, latency_prompts)
from micro_vllm import LLM, RequestOutputKind, SamplingParams


def measure(llm: LLM, batch_size: int, prompt_len: int, output_len: int, run: int = 0) -> dict[str, float]:
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = latency_prompts(batch_size, prompt_len, run, max_token_id=min(MAX_TOKEN_ID, engine.vocab_size - 1))
    requests = [engine.make_request(f"latency-{batch_size}-{run}-{i}", prompt, params)
                for i, prompt in enumerate(prompts)]
    first_token, finished, step_ms = {}, {}, []
    allocations_before = allocations()
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request.request_id, request)
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        done = engine.step()
        now = time.perf_counter()  # step() returns after the sampled tokens reached the host
        step_ms.append(1000 * (now - step_start))
        for request in requests:
            if request.request_id not in first_token and request.num_output_tokens > 0:
                first_token[request.request_id] = now - start
        for output in done:
            finished[output.request_id] = now - start
    ttft = [first_token[r.request_id] for r in requests]
    tpot = [(finished[r.request_id] - first_token[r.request_id]) / (output_len - 1) for r in requests]
    device_allocs, pinned_allocs = (after - before for after, before in zip(allocations(), allocations_before))
    return {"batch_size": batch_size, "run": run, "ttft_ms": 1000 * statistics.median(ttft),
            "tpot_ms": 1000 * statistics.median(tpot), "first_steps_ms": [round(ms, 1) for ms in step_ms[:4]],
            "device_allocs": device_allocs, "pinned_allocs": pinned_allocs}


def allocations() -> tuple[int, int]:
    """How many device and pinned host allocations PyTorch's caching allocators have made so far (0, 0
    without CUDA)."""
    if not torch.cuda.is_available():
        return 0, 0
    host = torch.cuda.host_memory_stats()
    return (torch.cuda.memory_stats().get("num_device_alloc", 0),
            host["num_host_alloc"] if "num_host_alloc" in host else host.get("allocations.allocated", 0))


def profile_batch(llm: LLM, batch_size: int, prompt_len: int, decode_steps: int = 20) -> None:
    """Print the kernel profile of a batch's prefill step (all its prompts in one step when the token
    budget allows), then of ``decode_steps`` of its decode steps: a step whose GPU busy time is far
    below its wall time is bound by the host."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    rng = random.Random(-1)  # a prompt no measured batch used, so the prefix cache serves none of it
    params = SamplingParams(max_tokens=decode_steps + 8, temperature=0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch_size):
        engine.add_request(f"profile-{i}", [rng.randint(0, 10000) for _ in range(prompt_len)], params)
    for what, steps in ((f"the prefill step of {batch_size} x {prompt_len} tokens", 1),
                        (f"{decode_steps} decode steps", decode_steps)):
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            wall_ms = 1000 * (time.perf_counter() - start)
        print(f"kernel profile, {what} (batch {batch_size}): {wall_ms:.2f} ms of wall time under the profiler")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
        print(gpu_busy(prof.events()))
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: random Qwen3-0.6B-shaped bf16 model)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(LATENCY_BATCH_SIZES))
    parser.add_argument("--prompt-len", type=int, default=LATENCY_PROMPT_LEN)
    parser.add_argument("--output-len", type=int, default=LATENCY_OUTPUT_LEN)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    parser.add_argument("--repeat", type=int, default=1, help="runs of all the batch sizes, each on new prompts")
    parser.add_argument("--json", help="append the results as one JSON line to this file")
    parser.add_argument("--profile", type=int, nargs="?", const=1, metavar="BATCH",
                        help="then print kernel profiles of a batch's steps (default: one request)")
    args = parser.parse_args()

    llm = LLM(model=args.model or str(build_random_model()), max_model_len=LATENCY_MAX_MODEL_LEN,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype)
    measure(llm, 1, 16, 8)  # warm-up
    rows = []
    for run in range(args.repeat):
        for batch_size in args.batch_sizes:
            row = measure(llm, batch_size, args.prompt_len, args.output_len, run)
            rows.append(row)
            print(f"run {run + 1}, batch {batch_size:3d}: TTFT {row['ttft_ms']:8.1f} ms   TPOT {row['tpot_ms']:6.2f} ms   "
                  f"first steps {row['first_steps_ms']} ms   allocations: device {row['device_allocs']}, "
                  f"pinned {row['pinned_allocs']}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "latency", **vars(args), "rows": rows}) + "\n")
    if args.profile:
        profile_batch(llm, args.profile, args.prompt_len)
    sync()


if __name__ == "__main__":
    main()
