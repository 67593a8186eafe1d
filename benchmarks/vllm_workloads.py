"""vLLM on the workloads of ``workloads.py``, beside ``throughput.py --workload W`` in the same GPU run
(``peer_workloads.sh`` runs both).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/vllm_workloads.py \\
        --model DIR --workload shared-prefix long-context --repeat 2
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/vllm_workloads.py --model DIR \\
        --sampling-params '[{"top_p": 0.95}, {"top_k": 50, "top_p": 0.9}]'

vLLM is imported from wherever the environment has it (this file holds none of its code); written
against vLLM 0.24's offline API, with the settings of the comparisons in docs/benchmarks.md ("Setup"):
bf16, 90% of GPU memory, no tokenizer, seed 0, vLLM's defaults otherwise (prefix caching on, as in
micro-vLLM). All the workloads named run in one engine, so its start-up is paid once; its
max_model_len is the largest of theirs unless given. After a short warm-up request each workload's
whole ``generate`` is timed ``--repeat`` times, each from an empty prefix cache, with the sampling of
throughput.py (temperature 0.6, EOS ignored) and, for each ``--sampling-params`` setting in turn
(a JSON object or a list of them; repeatable), that setting's fields added to every request as
throughput.py adds them (a seed: ``seed + i`` for request i). Each run prints ``RESULT {json}`` with
its output tokens per second and its setting.

``--latency`` times the latency batches instead (``latency.py``'s definition on vLLM's engine loop,
the same prompts): the batch's requests are added to ``LLMEngine`` at once and its ``step()`` driven;
a request's first token is timed at the step whose outputs first give it one, its last at the step
that finishes it. Each batch prints ``RESULT {json}`` with the median TTFT and TPOT over the batch.

A workload with a JSON schema (json-schema) constrains every request to it on vLLM's xgrammar
backend, as micro-vLLM does, and ends each at EOS. The engine then loads the checkpoint's tokenizer
(vLLM maps a grammar to token ids with it; outputs are still not detokenized), and the warm-up
compiles the schema's grammar, which xgrammar caches for the timed runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from workloads import (LATENCY_BATCH_SIZES, LATENCY_MAX_MODEL_LEN, LATENCY_OUTPUT_LEN, LATENCY_PROMPT_LEN, WORKLOADS,
                       latency_prompts, make_workload, request_settings, sampling_settings)

TEMPERATURE = 0.6


def result(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def engine_config(llm) -> dict:
    """The settings vLLM chose, for the record; a missing attribute is reported, not fatal."""
    try:
        config = llm.llm_engine.vllm_config
        return dict(max_num_seqs=config.scheduler_config.max_num_seqs,
                    max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                    prefix_caching=config.cache_config.enable_prefix_caching,
                    num_gpu_blocks=config.cache_config.num_gpu_blocks, block_size=config.cache_config.block_size)
    except AttributeError as e:
        return {"error": repr(e)}


def constraint(json_schema: dict | None) -> dict:
    """SamplingParams fields for a workload's schema: EOS ignored without one; with one, the output
    constrained to it (vLLM's ``StructuredOutputsParams``) and ended by EOS, as throughput.py does."""
    if json_schema is None:
        return {"ignore_eos": True}
    from vllm.sampling_params import StructuredOutputsParams

    return {"ignore_eos": False, "structured_outputs": StructuredOutputsParams(json=json_schema)}


def measure_latency(llm, batch_size: int, prompt_len: int, output_len: int) -> dict:
    """One latency batch on vLLM's engine loop, timed as latency.py times ours."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, detokenize=False)
    first_token, finished = {}, {}
    start = time.perf_counter()
    for i, prompt in enumerate(latency_prompts(batch_size, prompt_len)):
        engine.add_request(f"latency-{batch_size}-{prompt_len}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        for output in outputs:
            if output.outputs[0].token_ids:
                first_token.setdefault(output.request_id, now)
            if output.finished:
                finished[output.request_id] = now
    ttft = [first_token[request_id] for request_id in finished]
    tpot = [(finished[request_id] - first_token[request_id]) / (output_len - 1) for request_id in finished]
    return dict(step="vllm_latency", batch_size=batch_size, requests=len(finished), prompt_len=prompt_len,
                output_len=output_len, ttft_ms=round(1000 * statistics.median(ttft), 2),
                tpot_ms=round(1000 * statistics.median(tpot), 3))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=["recipe"])
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each workload")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests of each workload (throughput.py's option; default: the workload's own)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the largest of the workloads'")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's option: auto (the model's dtype) or fp8")
    parser.add_argument("--sampling-params", type=sampling_settings, action="append", metavar="JSON",
                        help="SamplingParams fields added to every request, a JSON object or a list of them: "
                             "each workload runs under each setting (default: temperature alone)")
    parser.add_argument("--latency", action="store_true",
                        help="time the latency batches (latency.py's) instead of the workloads")
    args = parser.parse_args(argv)
    settings = [s for group in args.sampling_params or [[{}]] for s in group]

    import vllm
    from vllm import LLM, SamplingParams

    workloads = {} if args.latency else {name: make_workload(name, args.num_requests) for name in args.workload}
    if args.max_model_len:
        max_model_len = args.max_model_len
    else:
        max_model_len = LATENCY_MAX_MODEL_LEN if args.latency else max(w.max_model_len for w in workloads.values())
    schemas = [w.json_schema for w in workloads.values() if w.json_schema is not None]
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=max_model_len, gpu_memory_utilization=0.9,
              skip_tokenizer_init=not schemas, seed=0, kv_cache_dtype=args.kv_cache_dtype,
              structured_outputs_config={"backend": "xgrammar"})
    startup = time.perf_counter() - start
    warm_up = [None] + schemas  # each schema's grammar is compiled here, and the bitmask kernel launched
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}] * len(warm_up),
                 [SamplingParams(max_tokens=16, detokenize=False, **constraint(s)) for s in warm_up], use_tqdm=False)
    result(dict(step="vllm_start", system=f"vLLM {vllm.__version__}", startup_s=round(startup, 1),
                max_model_len=max_model_len, kv_cache_dtype=args.kv_cache_dtype,
                config=engine_config(llm)))

    if args.latency:
        measure_latency(llm, 1, 16, 8)  # as latency.py warms up
        for batch_size in LATENCY_BATCH_SIZES:
            result(measure_latency(llm, batch_size, LATENCY_PROMPT_LEN, LATENCY_OUTPUT_LEN))
    for setting in settings:
        for name, workload in workloads.items():
            inputs = [{"prompt_token_ids": prompt} for prompt in workload.prompts]
            params = [SamplingParams(**{"temperature": TEMPERATURE, "max_tokens": n, "detokenize": False,
                                        **constraint(workload.json_schema), **request_settings(setting, i)})
                      for i, n in enumerate(workload.max_tokens)]
            for run in range(1, args.repeat + 1):
                llm.reset_prefix_cache()  # a run's prompts must not be served by the run before
                start = time.perf_counter()
                outputs = llm.generate(inputs, params, use_tqdm=False)  # returns once every token is on the host
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                result(dict(step="vllm_workload", workload=name, sampling=setting, run=run, requests=len(inputs),
                            output_tokens=tokens, seconds=round(seconds, 3), tok_per_s=round(tokens / seconds, 1),
                            cut_by_max_tokens=sum(o.outputs[0].finish_reason == "length" for o in outputs),
                            cached_prompt_tokens=sum(o.num_cached_tokens or 0 for o in outputs)))


if __name__ == "__main__":
    main()
