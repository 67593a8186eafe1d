"""micro-vLLM against transformers' ``generate`` on CPU, both in one process, on the default model.

    python benchmarks/cpu.py                          # 16 chat prompts, up to 128 new tokens each
    python benchmarks/cpu.py --num-prompts 64 --repeat 2
    python benchmarks/cpu.py --single --max-tokens 64   # one prompt: time per output token

Both sides get the same chat-templated prompts, decode greedily with EOS on, and count useful tokens:
each prompt's output up to and including its first EOS (transformers' padded batch keeps producing
padding after a row ends; micro-vLLM stops the request). transformers runs its plain padded batch
(left padding), as a user would call it. Each batched run also reports the CPU seconds the process
spent in it: on a machine shared with other work, the wall clock of a one-thread run stretches with
the load, its CPU time much less. ``--single`` times one prompt that ignores EOS on both
sides: time to the first token, then time per output token over the rest.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from micro_vllm import LLM, SamplingParams

TOPICS = ("the moon", "bread", "volcanoes", "a bicycle", "rain", "honey bees", "chess", "the ocean",
          "trains", "coffee", "glaciers", "owls", "paper", "music", "gardens", "clocks")
ASKS = ("Explain in a few sentences what {} is.", "Write a short poem about {}.",
        "Give three fun facts about {}.", "Tell a very short story about {}.")


def chat_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """``num_prompts`` distinct one-turn chats, as token ids the way ``LLM.chat`` renders them."""
    prompts = []
    for i in range(num_prompts):
        text = ASKS[(i // len(TOPICS)) % len(ASKS)].format(TOPICS[i % len(TOPICS)])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
    return prompts


def useful_tokens(token_ids: list[int], eos_token_ids: set[int]) -> int:
    """Tokens up to and including the first EOS (all of them when there is none)."""
    for i, token in enumerate(token_ids):
        if token in eos_token_ids:
            return i + 1
    return len(token_ids)


def eos_ids(model_dir) -> set[int]:
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def run_micro_vllm(llm: LLM, prompts, max_tokens: int, eos: set[int], ignore_eos: bool = False) -> tuple[int, float]:
    """One timed greedy ``generate`` from an empty prefix cache; useful tokens and seconds."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(useful_tokens(list(o.outputs[0].token_ids), set() if ignore_eos else eos) for o in outputs), seconds


def run_transformers(model, prompts, max_tokens: int, eos: set[int], pad_token_id: int,
                     ignore_eos: bool = False) -> tuple[int, float]:
    """One timed greedy ``model.generate`` over the prompts as one left-padded batch."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_token_id,
                  eos_token_id=None if ignore_eos else sorted(eos))
    if ignore_eos:
        kwargs["min_new_tokens"] = max_tokens
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    seconds = time.perf_counter() - start
    generated = output[:, width:].tolist()
    return sum(useful_tokens(row, set() if ignore_eos else eos) for row in generated), seconds


def with_cpu_time(run, *args):
    """``run(*args)`` and the CPU seconds this process spent in it."""
    start = time.process_time()
    result = run(*args)
    return result, time.process_time() - start


def time_per_output_token(run, max_tokens: int) -> tuple[float, float]:
    """TTFT and TPOT of one prompt, from a one-token run and a ``max_tokens`` run (both ignore EOS)."""
    _, first = run(1)
    tokens, total = run(max_tokens)
    return first, (total - first) / (tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most")
    parser.add_argument("--single", action="store_true", help="one prompt: TTFT and time per output token")
    parser.add_argument("--attention-backend", default="sdpa")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both sides")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each side, alternating")
    parser.add_argument("--json", help="append the results as one JSON line to this file")
    args = parser.parse_args()
    results = compare(args)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "cpu", **vars(args), **results}) + "\n")


def compare(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from micro_vllm.model_loader.default_model_download import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(args.model or default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = eos_ids(model_dir)
    prompts = chat_prompts(tokenizer, 1 if args.single else args.num_prompts)
    llm = LLM(model=model_dir, device="cpu", dtype="float32", attention_backend=args.attention_backend)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)

    def micro(n, ignore_eos=args.single):
        return run_micro_vllm(llm, prompts, n, eos, ignore_eos)

    def hf(n, ignore_eos=args.single):
        return run_transformers(model, prompts, n, eos, pad, ignore_eos)

    micro(4), hf(4)  # warm-up
    runs = []
    for _ in range(args.repeat):
        if args.single:
            (m_ttft, m_tpot), (h_ttft, h_tpot) = time_per_output_token(micro, args.max_tokens), \
                time_per_output_token(hf, args.max_tokens)
            row = {"micro_vllm": {"ttft_ms": round(1e3 * m_ttft, 1), "tpot_ms": round(1e3 * m_tpot, 2)},
                   "transformers": {"ttft_ms": round(1e3 * h_ttft, 1), "tpot_ms": round(1e3 * h_tpot, 2)},
                   "tpot_ratio": round(h_tpot / m_tpot, 2)}
            print(f"one prompt, {args.max_tokens} tokens: micro-vLLM TTFT {1e3 * m_ttft:.1f} ms, TPOT "
                  f"{1e3 * m_tpot:.2f} ms; transformers TTFT {1e3 * h_ttft:.1f} ms, TPOT {1e3 * h_tpot:.2f} ms; "
                  f"transformers TPOT / micro-vLLM TPOT = {h_tpot / m_tpot:.2f}x")
        else:
            ((m_tokens, m_s), m_cpu), ((h_tokens, h_s), h_cpu) = \
                with_cpu_time(micro, args.max_tokens), with_cpu_time(hf, args.max_tokens)
            ratio, cpu_ratio = (m_tokens / m_s) / (h_tokens / h_s), (m_tokens / m_cpu) / (h_tokens / h_cpu)
            row = {"micro_vllm": {"useful_tokens": m_tokens, "seconds": round(m_s, 2), "tok_per_s": round(m_tokens / m_s, 1),
                                  "cpu_seconds": round(m_cpu, 2)},
                   "transformers": {"useful_tokens": h_tokens, "seconds": round(h_s, 2), "tok_per_s": round(h_tokens / h_s, 1),
                                    "cpu_seconds": round(h_cpu, 2)},
                   "ratio": round(ratio, 2), "cpu_ratio": round(cpu_ratio, 2)}
            print(f"{len(prompts)} prompts x up to {args.max_tokens} tokens: micro-vLLM {m_tokens} tokens in "
                  f"{m_s:.2f} s = {m_tokens / m_s:.1f} tok/s ({m_cpu:.2f} CPU s); transformers {h_tokens} tokens "
                  f"in {h_s:.2f} s = {h_tokens / h_s:.1f} tok/s ({h_cpu:.2f} CPU s); ratio {ratio:.2f}x, "
                  f"by CPU time {cpu_ratio:.2f}x")
        runs.append(row)
    llm.shutdown()
    return {"threads": torch.get_num_threads(), "runs": runs}


if __name__ == "__main__":
    main()
