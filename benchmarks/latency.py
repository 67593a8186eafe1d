"""Time to first token and time per output token at batch sizes 1, 8 and 64.

    python benchmarks/latency.py [--model DIR] [--prompt-len 512] [--output-len 128]

All requests of a batch arrive at once; TTFT is measured from their arrival to the step that
produced their first token, TPOT over the rest of their tokens. Figures are medians over the batch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from bench_model import build_random_model
from micro_vllm import LLM, RequestOutputKind, SamplingParams


def measure(llm: LLM, batch_size: int, prompt_len: int, output_len: int) -> dict[str, float]:
    engine = llm.engine
    rng = random.Random(batch_size)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    requests = [
        engine.make_request(f"latency-{batch_size}-{i}", [rng.randint(0, 10000) for _ in range(prompt_len)], params)
        for i in range(batch_size)
    ]
    first_token, finished = {}, {}
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        done = engine.step()
        now = time.perf_counter()  # step() returns after the sampled tokens reached the host
        for request in requests:
            if request.request_id not in first_token and request.num_output_tokens > 0:
                first_token[request.request_id] = now - start
        for output in done:
            finished[output.request_id] = now - start
    ttft = [first_token[r.request_id] for r in requests]
    tpot = [(finished[r.request_id] - first_token[r.request_id]) / (output_len - 1) for r in requests]
    return {"batch_size": batch_size, "ttft_ms": 1000 * statistics.median(ttft), "tpot_ms": 1000 * statistics.median(tpot)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: random Qwen3-0.6B-shaped bf16 model)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", help="append the results as one JSON line to this file")
    args = parser.parse_args()

    llm = LLM(model=args.model or str(build_random_model()), max_model_len=4096, enforce_eager=args.enforce_eager)
    measure(llm, 1, 16, 8)  # warm-up
    rows = []
    for batch_size in args.batch_sizes:
        row = measure(llm, batch_size, args.prompt_len, args.output_len)
        rows.append(row)
        print(f"batch {batch_size:3d}: TTFT {row['ttft_ms']:8.1f} ms   TPOT {row['tpot_ms']:6.2f} ms")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "latency", **vars(args), "rows": rows}) + "\n")
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
