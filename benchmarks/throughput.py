"""Offline throughput on the recipe (nano-vllm's bench; docs/benchmarks.md, "The recipe"), or on another
workload of ``workloads.py`` (``vllm_workloads.py`` runs the same ones on vLLM).

    python benchmarks/throughput.py                      # random Qwen3-0.6B-shaped model
    python benchmarks/throughput.py --model DIR --compare-hf 16
    python benchmarks/throughput.py --sampling-params '{"logprobs": 5, "top_k": 50}'
    python benchmarks/throughput.py --model DIR --workload shared-prefix
    python benchmarks/throughput.py --distributed-executor-backend mp   # the model in a worker process

Prints output tokens, seconds and output tokens per second; with ``--compare-hf N`` it also runs
transformers' continuous batching on the first N requests in the same process, and micro-vLLM on the
same N requests, so the two figures come from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections import defaultdict

import torch

from bench_model import build_random_model
from workloads import WORKLOADS, make_workload, request_settings, sampling_settings
from micro_vllm import LLM, SamplingParams, StructuredOutputsParams
from micro_vllm.executor.multiproc_executor import MultiprocStepOutput
from micro_vllm.executor.single_process import SingleProcessExecutor
from micro_vllm.worker.step_output import DeviceStepOutput


def run_micro_vllm(llm: LLM, prompts, max_tokens, temperature: float, sampling_params: dict | None = None,
                   json_schema: dict | None = None) -> tuple[int, float, int, int]:
    """One timed ``generate`` of the prompts, from an empty prefix cache: an earlier run's cache
    (``--repeat``, the profiles, the recipe before the transformers comparison) would serve them.
    ``sampling_params`` (``--sampling-params``) adds SamplingParams fields to the recipe's, or
    replaces them (a seed: ``seed + i`` for request i, as on vLLM's side); ``json_schema`` (the
    workload's) constrains every request. Returns output tokens, seconds, prompt tokens the prefix
    cache served, and requests that max_tokens ended (all of them when EOS is ignored)."""
    params = [recipe_params(n, temperature, request_settings(sampling_params or {}, i), json_schema)
              for i, n in enumerate(max_tokens)]
    llm.reset_prefix_cache()
    sync()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    cached = sum(o.num_cached_tokens for o in outputs)
    cut = sum(o.outputs[0].finish_reason == "length" for o in outputs)
    return sum(len(o.outputs[0].token_ids) for o in outputs), seconds, cached, cut


def recipe_params(max_tokens: int, temperature: float, extra: dict | None,
                  json_schema: dict | None = None) -> SamplingParams:
    """The recipe's sampling (EOS ignored), or with ``json_schema`` output constrained to that schema
    and ended by EOS (which the grammar allows once the object is complete); ``extra`` over both."""
    fields = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": json_schema is None}
    if json_schema is not None:
        fields["structured_outputs"] = StructuredOutputsParams(json=json_schema)
    return SamplingParams(**{**fields, **(extra or {})})


def json_object(text: str) -> dict:
    """``--sampling-params``: one JSON object of SamplingParams fields (a process runs one setting)."""
    settings = sampling_settings(text)
    if len(settings) != 1:
        raise argparse.ArgumentTypeError(f"{text!r} holds {len(settings)} JSON objects; throughput.py runs one")
    return settings[0]


@contextlib.contextmanager
def time_phases(llm: LLM):
    """Accumulate wall time per phase of each engine step, and of ``step`` itself per kind of step
    (with the part of it spent in ``get_output``: a kind that waits little is bound by the host).

    ``schedule`` and ``update`` are CPU work. ``execute`` launches the step: input preparation
    (``prepare``), the forward pass (``forward``: a graph replay or eager launches), the logits' and
    the sampler's launches (``sample``); none of it should wait for the GPU. ``get_output`` waits for a step's
    tokens: with async scheduling, for the step before the one just launched. With the model in worker
    processes (``--distributed-executor-backend mp``) the runner's phases are theirs, not timed here, and
    ``get_output`` waits for rank 0's message."""
    totals: dict[str, float] = defaultdict(float)

    def timed(name, method):
        def wrapper(*args, **kwargs):
            start, waited_before = time.perf_counter(), totals["get_output"]
            result = method(*args, **kwargs)
            seconds = time.perf_counter() - start
            totals[name] += seconds
            totals[name + "_calls"] += 1
            if name == "step":
                stats = llm.engine.last_step_stats
                kind = _step_kind(stats.num_prefill_tokens, stats.num_decode_tokens)
                totals[kind] += seconds
                totals[kind + "_calls"] += 1
                totals[kind + "_wait"] += totals["get_output"] - waited_before
            return result
        return wrapper

    engine = llm.engine
    wrapped = [(engine.scheduler, "schedule"), (engine.scheduler, "update_from_output", "update"),
               (engine.executor, "execute_model", "execute"), (engine, "step")]
    if isinstance(engine.executor, SingleProcessExecutor):  # the runner is in this process
        runner = engine.executor.worker.model_runner
        wrapped += [(runner, "prepare_inputs", "prepare"), (runner, "run_model", "forward"), (runner, "sample"),
                    (DeviceStepOutput, "get_output")]
    else:
        wrapped.append((MultiprocStepOutput, "get_output"))
    saved = []
    for obj, method, *name in wrapped:
        saved.append((obj, method, obj.__dict__.get(method)))
        setattr(obj, method, timed(name[0] if name else method, getattr(obj, method)))
    try:
        yield totals
    finally:
        for obj, method, original in saved:
            if original is None:
                delattr(obj, method)  # the instance attribute shadowed the class's method
            else:
                setattr(obj, method, original)


@contextlib.contextmanager
def collector_pauses():
    """Count the garbage collector's collections and their wall time per generation: a full one
    (generation 2) scans every object the collector tracks, stalling whichever step it falls in."""
    pauses = {generation: [0, 0.0] for generation in range(3)}
    started = 0.0

    def callback(phase, info):
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            pause = pauses[info["generation"]]
            pause[0] += 1
            pause[1] += time.perf_counter() - started

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


PHASES = ("step", "schedule", "execute", "prepare", "forward", "sample", "get_output", "update")
STEP_KINDS = ("with prefill", "decodes 192+", "decodes 64-191", "decodes 16-63", "decodes 1-15")


def _step_kind(num_prefill_tokens: int, num_decodes: int) -> str:
    """Buckets for where the run's time goes: steps that prefill, then decode-only steps by size
    (the recipe's batch shrinks as requests finish: its long tail)."""
    if num_prefill_tokens:
        return STEP_KINDS[0]
    for kind, low in zip(STEP_KINDS[1:], (192, 64, 16)):
        if num_decodes >= low:
            return kind
    return STEP_KINDS[-1]


def triton_compilations() -> int:
    """Kernel variants Triton has compiled so far for micro-vLLM's own kernels: a step that compiles
    one waits for the compiler (start-up should have compiled them all)."""
    from triton.runtime.jit import JITFunction

    from micro_vllm.attention.backends import triton_attn
    from micro_vllm.layers import triton_ops
    from micro_vllm.sampling import triton_sampler

    modules = (triton_attn, triton_ops, triton_sampler)
    kernels = [v for module in modules for v in vars(module).values() if isinstance(v, JITFunction)]
    return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())


def profile_steps(llm: LLM, prompts, temperature: float, skip_steps: int, steps: int,
                  sampling_params: dict | None = None, json_schema: dict | None = None) -> str:
    """Profile ``steps`` engine steps after the first ``skip_steps`` of a run of ``prompts`` (from an
    empty prefix cache, so the prompts are computed) and return the kernel table: with 40 skipped,
    decodes; with 1 skipped, prefill steps of the recipe."""
    from torch.profiler import ProfilerActivity, profile, schedule

    engine = llm.engine
    step = engine.step
    caller_wrapper = vars(engine).get("step")  # put back after, whatever the caller had installed
    warmup = min(skip_steps, 2)
    llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=skip_steps - warmup, warmup=warmup, active=steps, repeat=1)) as prof:
        def profiled_step():
            result = step()
            prof.step()
            return result
        engine.step = profiled_step
        try:
            params = recipe_params(skip_steps + steps + 8, temperature, sampling_params, json_schema)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            if caller_wrapper is None:
                del engine.step
            else:
                engine.step = caller_wrapper
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n" + gpu_busy(prof.events())


def gpu_busy(events) -> str:
    """How much of the profiled window the GPU worked: the union of its kernels' and copies' intervals
    against the span from the first one's start to the last one's end (idle GPU is the rest). The
    profiler's own step annotations on the GPU timeline span everything and do not count."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in events
                       if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)
    if not intervals:
        return "GPU busy: no GPU activity recorded"
    busy, (run_start, run_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > run_end:
            busy, run_start = busy + run_end - run_start, start
        run_end = max(run_end, end)
    busy += run_end - run_start
    span = max(end for _, end in intervals) - intervals[0][0]
    return f"GPU busy: {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({100 * busy / span:.1f}%)"


def run_transformers(model_dir, prompts, max_new_tokens: int, temperature: float) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa", device_map="cuda"
    )
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                              eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:1], generation_config=config)  # warm-up
    sync()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    sync()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return sum(len(o.generated_tokens) for o in outputs.values()), seconds


def sync() -> None:
    """Wait for the GPU (no-op on CPU): timings cover the work, not only its launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: random Qwen3-0.6B-shaped bf16 model)")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="recipe", help="see workloads.py")
    parser.add_argument("--num-requests", type=int, default=None, help="default: the workload's (256, or 32 long-context)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the workload's (4096 for the recipe)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default=None, help="auto (the model's dtype) or fp8")
    parser.add_argument("--distributed-executor-backend", choices=["uni", "mp"], default=None,
                        help="uni: the model in this process (the default for one rank); mp: a worker process per rank "
                             "(its runner's phases and Triton compilations are not counted here)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="GPUs the model is split over")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of the whole recipe")
    parser.add_argument("--compare-hf", type=int, default=0, metavar="N", help="also run transformers on N requests")
    parser.add_argument("--hf-max-tokens", type=int, default=128, help="output tokens per request in the comparison")
    parser.add_argument("--custom-ops", type=lambda text: text.split(","), default=None, metavar="LIST",
                        help="ModelConfig.custom_ops, comma-separated (for before/after): --custom-ops=none,+sampler "
                             "runs the layers' PyTorch code, --custom-ops=-sampler the PyTorch sampler")
    parser.add_argument("--sampling-params", type=json_object, default={}, metavar="JSON",
                        help="more SamplingParams fields for every request, as a JSON object merged over the recipe's: "
                             """'{"logprobs": 5, "top_k": 50}'; a seed seeds request i with seed + i""")
    parser.add_argument("--profile", action="store_true", help="print kernel profiles of two prefill steps and of decode steps")
    parser.add_argument("--json", help="append the results as one JSON line to this file")
    args = parser.parse_args()

    model_dir = args.model or str(build_random_model())
    workload = make_workload(args.workload, args.num_requests)
    prompts, max_tokens = workload.prompts, workload.max_tokens
    max_model_len = args.max_model_len or workload.max_model_len
    schema = workload.json_schema
    print(f"workload {args.workload}: {len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, "
          f"{sum(max_tokens):,} output tokens{' at most (JSON schema)' if schema else ''}, "
          f"max_model_len {max_model_len}")
    engine_args = {k: v for k, v in dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                         attention_backend=args.attention_backend,
                                         kv_cache_dtype=args.kv_cache_dtype,
                                         distributed_executor_backend=args.distributed_executor_backend,
                                         tensor_parallel_size=args.tensor_parallel_size).items() if v is not None}
    start = time.perf_counter()
    llm = LLM(model=model_dir, max_model_len=max_model_len, enforce_eager=args.enforce_eager,
              custom_ops=args.custom_ops, **engine_args)
    startup = time.perf_counter() - start
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    if schema is not None:  # compile the schema's grammar and the bitmask kernel before the timed runs
        llm.generate([[1, 2, 3]], recipe_params(16, args.temperature, None, schema), use_tqdm=False)

    results = {"startup_s": round(startup, 1), "num_blocks": llm.engine.num_blocks, "runs": []}
    for _ in range(args.repeat):
        compiled_before = triton_compilations()
        with time_phases(llm) as phases, collector_pauses() as pauses:
            tokens, seconds, cached, cut = run_micro_vllm(llm, prompts, max_tokens, args.temperature,
                                                          args.sampling_params, schema)
        compiled = triton_compilations() - compiled_before
        steps = int(phases["schedule_calls"])
        breakdown = {k: round(1e6 * phases[k] / steps) for k in PHASES}
        by_kind = {k: {"steps": int(phases[k + "_calls"]), "seconds": round(phases[k], 3),
                       "waiting_s": round(phases[k + "_wait"], 3)} for k in STEP_KINDS}
        results["runs"].append({"output_tokens": tokens, "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds),
                                "cut_by_max_tokens": cut, "cached_prompt_tokens": cached,
                                "steps": steps, "us_per_step": breakdown, "time_by_step_kind": by_kind,
                                "triton_compilations": compiled,
                                "gc_collections": {g: {"count": n, "ms": round(1e3 * s, 1)} for g, (n, s) in pauses.items()}})
        print(f"micro-vllm: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s; "
              + (f"{cut} of {len(prompts)} requests cut by max_tokens; " if schema else "") +
              f"{steps} steps, mean us/step {breakdown}; Triton compilations during the run: {compiled}; "
              f"prompt tokens from the prefix cache: {cached:,}; garbage collections (generation: count, ms) "
              + ", ".join(f"{g}: {n}, {1e3 * s:.1f}" for g, (n, s) in pauses.items()))
        for kind, row in by_kind.items():
            mean, wait = (1e3 * row[k] / row["steps"] if row["steps"] else 0.0 for k in ("seconds", "waiting_s"))
            print(f"  steps {kind:>15}: {row['steps']:5d} steps, {row['seconds']:6.2f} s, {mean:6.2f} ms/step "
                  f"({wait:.2f} waiting for the GPU)")
    if args.profile:  # prefill steps, the full batch's decodes, and the long tail's few requests
        print("kernel profile, the recipe's 2nd and 3rd steps (prefill chunks of the 16,384-token budget):")
        print(profile_steps(llm, prompts, args.temperature, skip_steps=1, steps=2,
                            sampling_params=args.sampling_params, json_schema=schema))
        for n in (len(prompts), 8):
            print(f"kernel profile, steps of {n} decodes:")
            print(profile_steps(llm, prompts[:n], args.temperature, skip_steps=40, steps=10,
                                sampling_params=args.sampling_params, json_schema=schema))

    if args.compare_hf:
        n, budget = args.compare_hf, args.hf_max_tokens
        tokens, seconds, *_ = run_micro_vllm(llm, prompts[:n], [budget] * n, args.temperature, args.sampling_params)
        results["compare_micro_vllm"] = {"requests": n, "output_tokens": tokens, "seconds": round(seconds, 3)}
        print(f"micro-vllm on {n} requests x {budget} tokens: {tokens / seconds:,.0f} tok/s ({seconds:.2f} s)")
        llm.shutdown()
        torch.cuda.empty_cache()
        tokens, seconds = run_transformers(model_dir, prompts[:n], budget, args.temperature)
        results["compare_transformers"] = {"requests": n, "output_tokens": tokens, "seconds": round(seconds, 3)}
        print(f"transformers on {n} requests x {budget} tokens: {tokens / seconds:,.0f} tok/s ({seconds:.2f} s)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "throughput", **vars(args), **results}) + "\n")


if __name__ == "__main__":
    main()
