"""Time the benchmark model's linear layers alone, at the batch sizes a decode step has.

    python benchmarks/gemm_shapes.py [--batches 1 8 256] [--json results.jsonl]

Each projection of Qwen3-0.6B (bf16) runs over 28 distinct weight matrices in a row, as the 28
decoder layers do, so the weights come from HBM and not from L2 (one projection's weights for all
layers are 117 to 352 MB; L2 is 50 MB). Timed under a CUDA graph (``do_bench_cudagraph``) to leave
launch overhead out, with each of PyTorch's BLAS back ends. Reports microseconds per matmul and the
weight bytes read per second: at small batches a matmul can do no better than stream its weights.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench_model import QWEN3_0_6B

LAYERS = QWEN3_0_6B["num_hidden_layers"]
HIDDEN, INTERMEDIATE = QWEN3_0_6B["hidden_size"], QWEN3_0_6B["intermediate_size"]
HEADS, KV_HEADS, HEAD = QWEN3_0_6B["num_attention_heads"], QWEN3_0_6B["num_key_value_heads"], QWEN3_0_6B["head_dim"]
# name -> (in_features, out_features, matrices): the four projections of a layer, and the tied LM head
SHAPES = {
    "qkv_proj": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD, LAYERS),
    "o_proj": (HEADS * HEAD, HIDDEN, LAYERS),
    "gate_up_proj": (HIDDEN, 2 * INTERMEDIATE, LAYERS),
    "down_proj": (INTERMEDIATE, HIDDEN, LAYERS),
    "lm_head": (HIDDEN, QWEN3_0_6B["vocab_size"], 1),
}


def time_matmuls(batch: int, in_features: int, out_features: int, count: int) -> float:
    """Microseconds per matmul of ``batch`` rows through ``count`` distinct weights in a row."""
    from triton.testing import do_bench_cudagraph

    weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)

    def run():
        for weight in weights:
            F.linear(x, weight)

    return 1000 * do_bench_cudagraph(run, rep=100) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="append the results as one JSON line to this file")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64, 128, 256], help="rows per matmul")
    args = parser.parse_args()
    rows = []
    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        for batch in args.batches:
            step_us = 0.0
            for name, (in_features, out_features, count) in SHAPES.items():
                us = time_matmuls(batch, in_features, out_features, count)
                step_us += us * count
                weight_tbps = 2 * in_features * out_features / (us * 1e-6) / 1e12
                rows.append({"blas": backend, "batch": batch, "matmul": name, "per_step": count, "us": us,
                             "weight_TB/s": weight_tbps})
                print(f"{backend:8s} batch {batch:3d} {name:12s}: {us:7.1f} us  weights at {weight_tbps:5.2f} TB/s")
            print(f"{backend:8s} batch {batch:3d} all linear layers of a step: {step_us:7.1f} us")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "gemm_shapes", "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
