"""Time the Sampler alone on one step's logits: the old top-k / top-p (a sort of every row) and
penalties (PyTorch's) against the engine's, for the throughput recipe's batch.

    python benchmarks/sampler_bench.py [--rows 256] [--vocab 151936] [--device cuda] [--iters 50]

Random bf16 logits of ``rows`` x ``vocab`` (Qwen3's vocabulary), temperature 0.6 on every row, and
the settings of ``CASES``: plain temperature, ``top_k=50`` with ``top_p=0.9``, top-k alone, top-p
alone, min-p, ``logprobs=5``, and the three penalties (over counts of 500 output tokens and a prompt
of 500).
"before" runs the same Sampler with its top-k / top-p replaced by the sort of whole rows it had
before (``sorted_top_k_top_p_threshold`` below) and its penalties by PyTorch's (``apply_penalties``); "after"
is the engine's. On CUDA with both
sampler routes (PyTorch, and the Triton sampler the engine uses when its ``sampler`` op is on), timed
with CUDA events after warm-up; milliseconds per call, the median of ``iters``. ``--device cpu
--rows 8`` runs it as a smoke test (PyTorch route only; host wall time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from unittest import mock

import numpy as np
import torch

from micro_vllm.sampling import sampler as sampler_module
from micro_vllm.sampling.logits_processors import LogitsProcessorsMetadata, Penalties, apply_penalties
from micro_vllm.sampling.sampler import Sampler, SamplingMetadata, max_top_k

CASES = {
    "temperature": {},
    "top_k=50 top_p=0.9": {"top_k": 50, "top_p": 0.9},
    "top_k=50": {"top_k": 50},
    "top_p=0.9": {"top_p": 0.9},
    "top_p=0.95": {"top_p": 0.95},
    "min_p=0.05": {"min_p": 0.05},
    "logprobs=5": {"logprobs": 5},
    "penalties": {"penalties": True},  # repetition 1.1, presence 0.2, frequency 0.2
}


def sorted_top_k_top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                                 max_top_k: int | None = None, whole_row_top_p=None,
                                 inverse_temperature: torch.Tensor | None = None, top_k_top_p=None) -> torch.Tensor:
    """The top-k / top-p the Sampler had before, as a threshold: sort each whole row (scaled first,
    where the Sampler gives an ``inverse_temperature``), mask by rank and cumulative mass; the
    smallest logit kept. It takes ``top_k_top_p_threshold``'s arguments and uses neither route's
    search (``whole_row_top_p``, ``top_k_top_p``)."""
    if inverse_temperature is not None:
        logits = logits.float() * inverse_temperature.unsqueeze(-1)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p.unsqueeze(-1), float("-inf"))
    return sorted_logits.masked_fill(sorted_logits.isneginf(), float("inf")).amin(dim=-1, keepdim=True).float()


@contextmanager
def old_sampler(sampler: Sampler):
    """The Sampler as it was: top-k / top-p by sorting whole rows, the penalties in PyTorch."""
    with mock.patch.object(sampler_module, "top_k_top_p_threshold", sorted_top_k_top_p_threshold), \
            mock.patch.object(sampler, "penalize", apply_penalties):
        yield


def penalties_metadata(rows: int, vocab: int, device: torch.device) -> LogitsProcessorsMetadata:
    """Every row with repetition 1.1, presence 0.2 and frequency 0.2, over the counts of 500 output
    tokens and the mask of a 500-token prompt, drawn at random."""
    generator = torch.Generator(device=device).manual_seed(1)
    counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
    output = torch.randint(0, vocab, (rows, 500), generator=generator, device=device)
    counts.scatter_add_(1, output, torch.ones_like(output, dtype=torch.int32))
    prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, torch.randint(0, vocab, (rows, 500), generator=generator, device=device), True)

    def full(value: float) -> torch.Tensor:
        return torch.full((rows,), value, device=device)

    return LogitsProcessorsMetadata(penalties=Penalties(full(0.2), full(0.2), full(1.1), counts, prompt_mask))


def make_metadata(sampler: Sampler, rows: int, vocab: int, device: torch.device, top_k: int = 0,
                  top_p: float = 1.0, min_p: float = 0.0, logprobs: int | None = None,
                  penalties: bool = False) -> SamplingMetadata:
    top_k_rows = np.full(rows, top_k, np.int32)
    top_p_rows = np.full(rows, top_p, np.float32)
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), 0.6, device=device),
        top_k=torch.from_numpy(top_k_rows).to(device) if top_k else None,
        top_p=torch.from_numpy(top_p_rows).to(device) if top_p < 1 else None,
        all_greedy=False,
        all_random=True,
        max_num_logprobs=logprobs,
        max_top_k=max_top_k(top_k_rows),
        top_p_without_top_k=top_p < 1 and not top_k,
        logits_processors=penalties_metadata(rows, vocab, device) if penalties else None,
        min_p=torch.full((rows,), min_p, device=device) if min_p else None,
    )
    return sampler.add_row_seeds(metadata, {})  # the Triton route draws with the seeds it adds


def time_ms(call, device: torch.device, iters: int) -> float:
    """Milliseconds per call, the median of ``iters`` after two warm-up calls."""
    for _ in range(2):
        call()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            call()
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def run(rows: int, vocab: int, device: torch.device, iters: int) -> list[dict]:
    """One result per (sampler route, case): milliseconds per call before and after."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=generator, device=device) * 3).to(torch.bfloat16)
    results = []
    for use_triton in (False, True) if device.type == "cuda" else (False,):
        sampler = Sampler(use_triton, seed=0, device=device, max_num_reqs=rows)
        for case, settings in CASES.items():
            metadata = make_metadata(sampler, rows, vocab, device, **settings)
            call = lambda: sampler(logits, metadata)  # noqa: E731
            with old_sampler(sampler):
                before = time_ms(call, device, iters)
            after = time_ms(call, device, iters)
            results.append({"route": "triton" if use_triton else "pytorch", "case": case, "before_ms": before,
                            "after_ms": after})
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results = run(args.rows, args.vocab, device, args.iters)
    print(f"{args.rows} rows x {args.vocab} tokens on {device}, ms per call (median of {args.iters})")
    print(f"{'route':8} {'case':20} {'before':>8} {'after':>8} {'after/before':>13}")
    for r in results:
        print(f"{r['route']:8} {r['case']:20} {r['before_ms']:8.3f} {r['after_ms']:8.3f} "
              f"{r['after_ms'] / r['before_ms']:13.2f}")
    return results


if __name__ == "__main__":
    main()
