"""Load generator for a running ``micro-vllm serve`` (or any OpenAI-compatible server).

    micro-vllm serve MODEL --port 8000 &
    python benchmarks/serve.py --url http://localhost:8000 --request-rate inf 8 32 --concurrency 64 256

Sends the throughput recipe's requests (``workloads.recipe``: prompts of token ids, output
lengths, EOS ignored) as streamed ``/v1/completions``, arriving as a Poisson process at each request rate
("inf": all at once) under each concurrency cap, after one short warm-up request, and prints one JSON
object per timed run of each (rate, concurrency):
output throughput, time to first token and time per output token at p50 and p99, and the share of
a core the busiest client process used (near 1, the client and not the server limited the run:
raise ``--client-processes``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from dataclasses import dataclass

import httpx

from workloads import recipe


@dataclass
class RequestResult:
    ttft: float  # seconds to the first streamed chunk
    latency: float  # seconds to the end of the stream
    output_tokens: int

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None for a single token)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _send(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                temperature: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, output_tokens = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:  # the first chunk carries the first token's text
                ttft = time.perf_counter() - start
            # Only the last chunk has a usage object: parsing every chunk would make this client,
            # not the server, the bottleneck at saturation.
            if '"usage"' in line and '"usage":null' not in line:
                output_tokens = json.loads(line[len("data: "):])["usage"]["completion_tokens"]
    return RequestResult(ttft=ttft, latency=time.perf_counter() - start, output_tokens=output_tokens)


async def _client(url: str, model: str, prompts: list[list[int]], max_tokens: list[int], request_rate: float,
                  concurrency: int, temperature: float, seed: int, api_key: str | None):
    """One client's share of the run: its results, its wall-clock start and end, and its CPU seconds."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)

    async def one(http, prompt, n):
        async with limit:
            return await _send(http, model, prompt, n, temperature)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=headers) as http:
        start, cpu_start = time.time(), time.process_time()
        tasks = []
        for prompt, n in zip(prompts, max_tokens):
            tasks.append(asyncio.create_task(one(http, prompt, n)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, start, time.time(), time.process_time() - cpu_start


def _client_process(args: tuple):
    return asyncio.run(_client(*args))


def run(url: str, model: str, prompts: list[list[int]], max_tokens: list[int], request_rate: float,
        concurrency: int, temperature: float = 0.6, seed: int = 0, api_key: str | None = None,
        client_processes: int = 1) -> dict:
    """Send every request (Poisson arrivals at ``request_rate`` per second, at most ``concurrency``
    in flight) and return the figures of the run. With ``client_processes`` > 1 the requests, the
    rate and the concurrency are dealt out to that many processes, so that one Python process's
    parsing of the streams does not cap what the server is seen to do."""
    shares = [(url, model, prompts[k::client_processes], max_tokens[k::client_processes],
               request_rate / client_processes, -(-concurrency // client_processes), temperature, seed + k, api_key)
              for k in range(client_processes)]
    if client_processes == 1:
        parts = [_client_process(shares[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(client_processes) as pool:
            parts = pool.map(_client_process, shares)
    results = [r for part in parts for r in part[0]]
    seconds = max(part[2] for part in parts) - min(part[1] for part in parts)
    client_cpu = max(part[3] for part in parts) / seconds
    output_tokens = sum(r.output_tokens for r in results)
    ttfts = [r.ttft for r in results]
    tpots = [r.tpot for r in results if r.tpot is not None] or [0.0]
    return {
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "concurrency": concurrency,
        "client_processes": client_processes,
        "num_requests": len(results),
        "seconds": round(seconds, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / seconds, 1),
        "requests_per_s": round(len(results) / seconds, 3),
        "ttft_ms_p50": _ms(_percentile(ttfts, 50)), "ttft_ms_p99": _ms(_percentile(ttfts, 99)),
        "tpot_ms_p50": _ms(_percentile(tpots, 50)), "tpot_ms_p99": _ms(_percentile(tpots, 99)),
        "client_cpu_share": round(client_cpu, 2),  # the busiest client's; near 1, the client set the pace
    }


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                        help="requests per second, Poisson arrivals; inf sends all at once")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256], help="most requests in flight")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each (rate, concurrency)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="processes sending the requests (each a share of them); more when one is near a full core")
    parser.add_argument("--max-prompt-len", type=int, default=None, help="cut the recipe's prompts to this many tokens")
    parser.add_argument("--max-output-len", type=int, default=None, help="cap the recipe's output lengths")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="fold the recipe's token ids into a smaller vocabulary")
    args = parser.parse_args(argv)

    workload = recipe(args.num_requests)
    prompts, max_tokens = workload.prompts, workload.max_tokens
    if args.max_prompt_len:
        prompts = [p[:args.max_prompt_len] for p in prompts]
    if args.max_output_len:
        max_tokens = [min(n, args.max_output_len) for n in max_tokens]
    if args.vocab_size:
        prompts = [[t % args.vocab_size for t in p] for p in prompts]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{args.url}/v1/models", headers=headers).json()["data"][0]["id"]
    # One short request first, as the offline benchmark does: the server's first request pays for
    # what runs once (imports on first use, the first response's serialization setup).
    run(args.url, model, [prompts[0][:8]], [16], float("inf"), 1, args.temperature, api_key=args.api_key)
    for rate in args.request_rate:
        for concurrency in args.concurrency:
            for _ in range(args.repeat):
                print(json.dumps(run(args.url, model, prompts, max_tokens, rate, concurrency, args.temperature,
                                     api_key=args.api_key, client_processes=args.client_processes)), flush=True)


if __name__ == "__main__":
    main()
