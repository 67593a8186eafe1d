"""Each workload's physical floor: the least time any engine could take on it, from the bytes it must
move through HBM at the GPU's copy rate and the matmul work it must do at the GPU's matmul rate.

    python benchmarks/floor.py                                   # every workload, the bench model, documented rates
    python benchmarks/floor.py --model DIR --kv-cache-dtype fp8 --workload long-context
    python benchmarks/floor.py --measure --measured recipe=TOKS_PER_S   # rates measured on a CUDA GPU
    python benchmarks/floor.py --workload latency                # the latency batches' TTFT and TPOT floors

What it counts, a lower bound for every engine (``workloads.py`` ignores EOS, so lengths are known):
- K/V (a token's K and V over all layers): each output token costs its request's whole context once.
  The first comes from the prefill, which writes the prompt's K/V once; its attention reads the
  step's own K/V, counted as on-chip tiles. Each later output token is a decode that reads the K/V of
  every earlier token and writes the fed token's. A prefix common to all prompts (shared-prefix's
  system prompt) is prefilled once (prefix caching) and read once per decode step, not per request:
  the step's requests all read the same blocks, which cascade attention (vLLM has it) reads once and
  micro-vLLM's decode kernel finds in L2 (docs/benchmarks.md: a measured run beats per-request reads).
  No other overlap of the random prompts counts.
- Weights: every parameter once a step (the tied embedding once, as the LM head; the embedding
  lookup reads only rows, left out), over the fewest steps: the longest request's output length, as
  every workload's requests (at most 256; both engines take 1,024 a step) decode in one batch and
  their K/V fits in an H200's memory.
- Compute: the linear layers' 2 x params x tokens through them, the LM head's on the sampled tokens
  only, and attention's QK and PV over the causal (query, key) pairs.
Left out: activations, and the logits that the LM head writes and the sampler reads for each sampled
token (2 bytes each way a vocabulary entry: 81 GB over the recipe, 0.5% of its floor).
The floor is the larger of the memory time and the compute time; the ceiling is output tokens over it.
``latency`` is the latency batches (1, 8 and 64 prompts of 512 tokens, 128 output tokens each): its
TTFT floor is the prefill step's, its TPOT floor the mean of the decode steps', each step the larger of
its own memory and compute times, since a step cannot start before the one it follows has sampled.
Rates: ``--measure`` times a 4 GiB bf16 ``clone`` (bytes read plus written) and an 8,192-cube bf16
matmul on CUDA; otherwise ``--bandwidth-tbs`` and ``--tflops``, by default docs/benchmarks.md's.
Prints a Markdown table and a ``RESULT {json}`` line per workload.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from bench_model import QWEN3_0_6B
from workloads import (LATENCY_BATCH_SIZES, LATENCY_OUTPUT_LEN, LATENCY_PROMPT_LEN, WORKLOADS, Workload,
                       latency_prompts, make_workload)

# The workloads whose output lengths are known ahead (EOS ignored): json-schema's requests end where
# their objects do.
FIXED_LENGTH_WORKLOADS = [name for name in WORKLOADS if name != "json-schema"]
DOCUMENTED_TBS, DOCUMENTED_TFLOPS = 4.19, 772.0  # docs/benchmarks.md: an H200, measured as --measure does
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """What the floor needs of a dense, full-attention Llama-family model: its matmul weights, its
    RMSNorm weights (with q/k norms for Qwen3), no biases (Qwen2's are a few thousand parameters)."""
    layers: int
    heads: int
    head_dim: int
    kv_values_per_token: int  # K and V of one token over all layers
    layer_params: int  # the decoder layers' matmul weights, all layers
    lm_head_params: int
    norm_params: int
    dtype_bytes: int

    @property
    def step_weight_bytes(self) -> int:
        """Every parameter, read once a step."""
        return (self.layer_params + self.lm_head_params + self.norm_params) * self.dtype_bytes

    def kv_token_bytes(self, kv_cache_dtype: str) -> int:
        """One token's K/V over all layers in the cache's dtype (``fp8``: one byte a value)."""
        return self.kv_values_per_token * (1 if kv_cache_dtype == "fp8" else self.dtype_bytes)

    def linear_flops(self, tokens: int, sampled: int) -> int:
        """``tokens`` through the decoder layers' matmuls, ``sampled`` of them through the LM head."""
        return 2 * (self.layer_params * tokens + self.lm_head_params * sampled)

    def attention_flops(self, pairs: int) -> int:
        """QK and PV over ``pairs`` (query, key) pairs, every head of every layer."""
        return 4 * self.layers * self.heads * self.head_dim * pairs

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        hidden, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        norms = 2 * hidden + (2 * head_dim if config.get("model_type") == "qwen3" else 0)
        return cls(layers, heads, head_dim, layers * kv_heads * head_dim * 2,
                   layers * (attention + 3 * hidden * config["intermediate_size"]),
                   config["vocab_size"] * hidden, layers * norms + hidden, DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class Traffic:
    """A workload's work in tokens, whatever the model."""
    output_tokens: int
    steps: int
    kv_read_tokens: int  # K/V entries the decodes read
    kv_written_tokens: int  # K/V entries written: the tokens through the layers
    attention_pairs: int  # (query, key) pairs attention multiplies


def traffic(workload: Workload) -> Traffic:
    """The module docstring's counts; ``prefix`` is the prompts' common prefix, each prompt's ``own`` the rest."""
    prefix = len(os.path.commonprefix(workload.prompts))
    steps = max(workload.max_tokens)
    reads, written, pairs = prefix * (steps - 1), prefix, prefix * (prefix + 1) // 2
    for prompt, n in zip(workload.prompts, workload.max_tokens):
        own = len(prompt) - prefix
        # The decode of output token k >= 2 reads its own prompt tokens and outputs 1 to k - 2 (output
        # k - 1 is fed in: its K/V is made in the step) and writes output k - 1's K/V.
        reads += (n - 1) * own + (n - 1) * (n - 2) // 2
        written += own + n - 1
        # Prefill: own prompt token j attends to the prefix and own tokens 1 to j; decode k: to the
        # prompt and outputs 1 to k - 1.
        pairs += own * prefix + own * (own + 1) // 2 + (n - 1) * len(prompt) + n * (n - 1) // 2
    return Traffic(sum(workload.max_tokens), steps, reads, written, pairs)


def floor(workload: Workload, model: ModelShape, kv_cache_dtype: str, bandwidth_tbs: float, tflops: float) -> dict:
    """The workload's bytes, FLOPs, floor seconds and ceiling output tok/s."""
    t = traffic(workload)
    kv_token_bytes = model.kv_token_bytes(kv_cache_dtype)
    result = dict(output_tokens=t.output_tokens, steps=t.steps, kv_read_bytes=t.kv_read_tokens * kv_token_bytes,
                  kv_written_bytes=t.kv_written_tokens * kv_token_bytes, weight_bytes=t.steps * model.step_weight_bytes,
                  linear_flops=model.linear_flops(t.kv_written_tokens, t.output_tokens),
                  attention_flops=model.attention_flops(t.attention_pairs))
    memory_s = (result["kv_read_bytes"] + result["kv_written_bytes"] + result["weight_bytes"]) / (bandwidth_tbs * 1e12)
    compute_s = (result["linear_flops"] + result["attention_flops"]) / (tflops * 1e12)
    seconds = max(memory_s, compute_s)
    return {**result, "memory_s": memory_s, "compute_s": compute_s, "floor_s": seconds,
            "ceiling_tok_per_s": t.output_tokens / seconds}


def latency_floor(batch_size: int, model: ModelShape, kv_cache_dtype: str, bandwidth_tbs: float, tflops: float,
                  prompt_len: int = LATENCY_PROMPT_LEN, output_len: int = LATENCY_OUTPUT_LEN) -> dict:
    """A latency batch's TTFT floor (its prefill step's) and TPOT floor (the mean of its decode steps'), in ms."""
    prompts = latency_prompts(batch_size, prompt_len)
    ttft_s = floor(Workload(prompts, [1] * batch_size, prompt_len + 1), model, kv_cache_dtype, bandwidth_tbs,
                   tflops)["floor_s"]
    kv_token_bytes = model.kv_token_bytes(kv_cache_dtype)
    decode_s = 0.0
    for k in range(2, output_len + 1):
        # Output k's decode (``traffic``): each request reads its prompt and outputs 1 to k - 2, writes
        # output k - 1's K/V, and attends over the prompt and outputs 1 to k - 1.
        memory_bytes = model.step_weight_bytes + batch_size * (prompt_len + k - 1) * kv_token_bytes
        flops = model.linear_flops(batch_size, batch_size) + model.attention_flops(batch_size * (prompt_len + k - 1))
        decode_s += max(memory_bytes / (bandwidth_tbs * 1e12), flops / (tflops * 1e12))
    return {"batch_size": batch_size, "prompt_len": prompt_len, "output_len": output_len,
            "ttft_floor_ms": 1000 * ttft_s, "tpot_floor_ms": 1000 * decode_s / (output_len - 1)}


def measure_rates() -> tuple[float, float]:
    """Copy TB/s (a 4 GiB bf16 clone, read plus written) and bf16 matmul TFLOP/s (8,192 cube) on CUDA:
    medians of 10 runs timed with CUDA events, after 3 warm-ups."""
    import statistics

    import torch

    def median_ms(fn) -> float:
        times = []
        for i in range(13):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times += [start.elapsed_time(end)] if i >= 3 else []
        return statistics.median(times)

    x = torch.randn(2 * 2**30, dtype=torch.bfloat16, device="cuda")
    bandwidth = 2 * x.nbytes / median_ms(x.clone) / 1e9
    del x
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    return bandwidth, 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9


def measured_figure(text: str) -> tuple[str, float]:
    """``--measured WORKLOAD=TOKS_PER_S``."""
    name, _, value = text.partition("=")
    try:
        if name in FIXED_LENGTH_WORKLOADS and float(value) > 0:
            return name, float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--measured {text!r} is not WORKLOAD=TOKS_PER_S, a workload of "
                                     f"{sorted(FIXED_LENGTH_WORKLOADS)} and a positive output tok/s")


def markdown_table(results: list[dict]) -> str:
    rows = ["| workload | output tokens | steps | K/V TB read + written | weights TB | PFLOP | memory s | compute s "
            "| floor s | ceiling tok/s | measured tok/s | of ceiling |", "| --- |" + " ---: |" * 11]
    for r in results:
        reached = f" {r['measured_tok_per_s']:,.0f} | {100 * r['of_ceiling']:.0f}% |" if "of_ceiling" in r else " | |"
        rows.append(f"| {r['workload']} | {r['output_tokens']:,} | {r['steps']:,} | {r['kv_read_bytes'] / 1e12:.2f} + "
                    f"{r['kv_written_bytes'] / 1e12:.2f} | {r['weight_bytes'] / 1e12:.2f} | "
                    f"{(r['linear_flops'] + r['attention_flops']) / 1e15:.2f} | {r['memory_s']:.2f} | "
                    f"{r['compute_s']:.2f} | {r['floor_s']:.2f} | {r['ceiling_tok_per_s']:,.0f} |" + reached)
    return "\n".join(rows)


def latency_table(results: list[dict]) -> str:
    rows = ["| batch | prompt / output tokens | TTFT floor ms | TPOT floor ms |", "| ---: | ---: | ---: | ---: |"]
    rows += [f"| {r['batch_size']} | {r['prompt_len']} / {r['output_len']} | {r['ttft_floor_ms']:.2f} | "
             f"{r['tpot_floor_ms']:.3f} |" for r in results]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", choices=[*FIXED_LENGTH_WORKLOADS, "latency"],
                        default=[*FIXED_LENGTH_WORKLOADS, "latency"])
    parser.add_argument("--model", help="checkpoint directory whose config.json gives the shape (default: Qwen3-0.6B)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: the model's dtype")
    parser.add_argument("--measure", action="store_true", help="measure the copy and matmul rates on CUDA")
    parser.add_argument("--bandwidth-tbs", type=float, default=DOCUMENTED_TBS, help="copy rate, read plus written")
    parser.add_argument("--tflops", type=float, default=DOCUMENTED_TFLOPS, help="bf16 matmul rate")
    parser.add_argument("--measured", type=measured_figure, nargs="+", default=[], metavar="WORKLOAD=TOKS_PER_S",
                        help="output tok/s a run reached, to print the fraction of the ceiling")
    args = parser.parse_args(argv)
    if args.bandwidth_tbs <= 0 or args.tflops <= 0:
        parser.error(f"--bandwidth-tbs {args.bandwidth_tbs} and --tflops {args.tflops} must be positive")
    measured = dict(args.measured)
    if set(measured) - set(args.workload):
        parser.error(f"--measured names {sorted(set(measured) - set(args.workload))}, not in --workload {args.workload}")
    config = {"model_type": "qwen3", **QWEN3_0_6B}
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            config = json.load(f)
    model = ModelShape.from_config(config)
    if args.measure:
        args.bandwidth_tbs, args.tflops = measure_rates()
        source = "measured here"
    elif (args.bandwidth_tbs, args.tflops) == (DOCUMENTED_TBS, DOCUMENTED_TFLOPS):
        source = "docs/benchmarks.md's H200 figures; --measure measures them"
    else:
        source = "given"
    print(f"copy {args.bandwidth_tbs:.2f} TB/s, bf16 matmul {args.tflops:.0f} TFLOP/s ({source}); "
          f"{args.model or 'Qwen3-0.6B'}, KV cache {args.kv_cache_dtype}\n")
    common = {"benchmark": "floor", "kv_cache_dtype": args.kv_cache_dtype, "bandwidth_tbs": args.bandwidth_tbs,
              "tflops": args.tflops}
    results = []
    for name in [n for n in args.workload if n != "latency"]:
        r = {**common, "workload": name,
             **floor(make_workload(name), model, args.kv_cache_dtype, args.bandwidth_tbs, args.tflops)}
        if name in measured:
            r.update(measured_tok_per_s=measured[name], of_ceiling=measured[name] / r["ceiling_tok_per_s"])
        results.append(r)
    latencies = [{**common, "workload": "latency",
                  **latency_floor(batch_size, model, args.kv_cache_dtype, args.bandwidth_tbs, args.tflops)}
                 for batch_size in LATENCY_BATCH_SIZES if "latency" in args.workload]
    if results:
        print(markdown_table(results) + "\n")
    if latencies:
        print(latency_table(latencies) + "\n")
    for r in results + latencies:
        print("RESULT " + json.dumps(r))
    return results + latencies


if __name__ == "__main__":
    main()
