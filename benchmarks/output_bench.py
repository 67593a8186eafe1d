"""Host time of making a step's outputs for streaming requests: ``OutputProcessor.process_step``.

In the server every request streams (``RequestOutputKind.DELTA``), so each step detokenizes each
running request's new token and makes its ``RequestOutput``, in the engine's process, between steps
(docs/benchmarks.md, "Serving"). Here ``--requests`` such requests (prompts of 300 random ids below
10,000, the benchmark model's word-level tokenizer of 151,936 ids: ``bench_model.save_word_tokenizer``)
each get one random token a step for ``--steps`` steps, and the median time of ``process_step`` is
printed for each span of ``--span`` steps, so that a cost growing with the output shows.

    python benchmarks/output_bench.py [--requests 256] [--steps 4000] [--span 500]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench_model import save_word_tokenizer
from transformers import AutoTokenizer

from micro_vllm.core.request import Request, RequestStatus
from micro_vllm.engine.output_processor import OutputProcessor
from micro_vllm.sampling.params import RequestOutputKind, SamplingParams

VOCAB_SIZE = 151_936


def streaming_requests(processor: OutputProcessor, num_requests: int, max_tokens: int, seed: int = 0) -> list[Request]:
    """Running requests that stream deltas, tracked by ``processor`` as the engine adds them."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    requests = []
    for i in range(num_requests):
        request = Request(f"stream-{i}", [rng.randrange(10_000) for _ in range(300)], params,
                          frozenset({VOCAB_SIZE - 1}))
        request.status = RequestStatus.RUNNING
        processor.add_request(request, None)
        requests.append(request)
    return requests


def time_steps(processor: OutputProcessor, requests: list[Request], num_steps: int, seed: int = 1) -> list[float]:
    """Seconds of ``process_step`` for each of ``num_steps`` steps that give every request a token."""
    rng, req_ids, times = random.Random(seed), [r.request_id for r in requests], []
    for _ in range(num_steps):
        for request in requests:
            request.append_output_token(rng.randrange(10_000))
        start = time.perf_counter()
        outputs, stopped = processor.process_step(req_ids)
        times.append(time.perf_counter() - start)
        assert len(outputs) == len(requests) and not stopped
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--span", type=int, default=500, help="steps per printed median")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        save_word_tokenizer(Path(directory), VOCAB_SIZE)
        processor = OutputProcessor(AutoTokenizer.from_pretrained(directory))
    requests = streaming_requests(processor, args.requests, args.steps)
    times = time_steps(processor, requests, args.steps)
    for first in range(0, args.steps, args.span):
        span = times[first:first + args.span]
        print(f"output tokens {first:5d} to {first + len(span):5d}: process_step median "
              f"{1000 * statistics.median(span):.3f} ms for {args.requests} streams")


if __name__ == "__main__":
    main()
