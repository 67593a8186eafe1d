"""The Prometheus exporter: scheduler snapshots and iteration stats into vLLM's metric names.

Every metric lives in the logger's own registry (one server, one registry; tests build several) and
carries vLLM's ``model_name`` and ``engine`` labels: a server with data-parallel replicas has one
series per replica (``engine="0"``, ``engine="1"``...), summed by whoever reads them. Gauges take the
latest snapshot; counters add up what each step planned or gave out; histograms take one sample per
token or per finished request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from micro_vllm.metrics.stats import IterationStats, SchedulerStats

# Latency buckets in seconds, from a fast GPU decode step to a long CPU request.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class PrometheusStatLogger:
    """The metrics of the engines ``engine_indexes`` (one per data-parallel replica); ``record`` takes
    one engine's figures."""

    def __init__(self, model_name: str, engine_indexes: Iterable[int] = (0,)) -> None:
        self.registry = CollectorRegistry()
        engines = [str(index) for index in engine_indexes]

        def make(kind, name: str, documentation: str, **kwargs) -> dict[int, Any]:
            """The metric's series of each engine, by engine index."""
            metric = kind(name, documentation, labelnames=["model_name", "engine"], registry=self.registry, **kwargs)
            return {int(engine): metric.labels(model_name=model_name, engine=engine) for engine in engines}

        self.num_requests_running = make(Gauge, "vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = make(Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = make(Gauge, "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.prefix_cache_queries = make(Counter, "vllm:prefix_cache_queries",
                                         "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = make(Counter, "vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.num_preemptions = make(Counter, "vllm:num_preemptions", "Requests preempted.")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Generated tokens.")
        self.time_to_first_token = make(Histogram, "vllm:time_to_first_token_seconds",
                                        "Time from arrival to the first token.", buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = make(Histogram, "vllm:inter_token_latency_seconds",
                                        "Time between two outputs of a request.", buckets=_LATENCY_BUCKETS)
        self.time_per_output_token = make(Histogram, "vllm:request_time_per_output_token_seconds",
                                          "A finished request's mean time per output token after the first.",
                                          buckets=_LATENCY_BUCKETS)
        self.e2e_latency = make(Histogram, "vllm:e2e_request_latency_seconds",
                                "Time from arrival to the last output.", buckets=_LATENCY_BUCKETS)
        self.request_prompt_tokens = make(Histogram, "vllm:request_prompt_tokens",
                                          "Prompt tokens of finished requests.", buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = make(Histogram, "vllm:request_generation_tokens",
                                              "Generated tokens of finished requests.", buckets=_TOKEN_BUCKETS)
        self._request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                        labelnames=["model_name", "engine", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.num_requests_running[engine_idx].set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting[engine_idx].set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage[engine_idx].set(scheduler_stats.kv_cache_usage)
            self.prefix_cache_queries[engine_idx].inc(scheduler_stats.prefix_cache_stats.queries)
            self.prefix_cache_hits[engine_idx].inc(scheduler_stats.prefix_cache_stats.hits)
            self.num_preemptions[engine_idx].inc(scheduler_stats.num_preempted_reqs)
        if iteration_stats is None:
            return
        self.prompt_tokens[engine_idx].inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens[engine_idx].inc(iteration_stats.num_generation_tokens)
        for seconds in iteration_stats.time_to_first_tokens:
            self.time_to_first_token[engine_idx].observe(seconds)
        for seconds in iteration_stats.inter_token_latencies:
            self.inter_token_latency[engine_idx].observe(seconds)
        for finished in iteration_stats.finished_requests:
            self.e2e_latency[engine_idx].observe(finished.e2e_latency)
            if finished.mean_time_per_output_token is not None:
                self.time_per_output_token[engine_idx].observe(finished.mean_time_per_output_token)
            self.request_prompt_tokens[engine_idx].observe(finished.num_prompt_tokens)
            self.request_generation_tokens[engine_idx].observe(finished.num_generation_tokens)
            self._request_success.labels(model_name=self._model_name, engine=str(engine_idx),
                                         finished_reason=finished.finish_reason).inc()

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
