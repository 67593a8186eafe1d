"""The Prometheus exporter: scheduler snapshots and iteration stats into vLLM's metric names.

Every metric lives in the logger's own registry (one server, one registry; tests build several) and
carries vLLM's labels, ``model_name`` and ``engine``: a server with data-parallel replicas has one
series per replica (``engine="0"``, ``engine="1"``...), summed by whoever reads them. Gauges take the
latest snapshot; counters add up what each step planned or gave out; histograms take one sample per step,
per token or per finished request. The families are vLLM's (its ``PrometheusStatLogger``) except
those this engine has nothing to report for (docs/serving.md, "Metrics", lists them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from micro_vllm.config import CacheConfig
from micro_vllm.metrics.stats import IterationStats, SchedulerStats

# vLLM's buckets: time to first token; inter-token latency and time per output token; a request's phases.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# Token counts, 1-2-5 up to 100,000 (vLLM's stop at the model's length, which the logger is built without).
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    """The metrics of the engines ``engine_indexes`` (one per data-parallel replica); ``record`` takes
    one engine's figures."""

    def __init__(self, model_name: str, cache_config: CacheConfig, engine_indexes: Iterable[int] = (0,)) -> None:
        self.registry = CollectorRegistry()
        self._cache_config = cache_config
        self._cache_config_info: Gauge | None = None
        families: dict[str, object] = {}
        self.engines = {index: _EngineMetrics(self.registry, families, {"model_name": model_name, "engine": str(index)})
                        for index in engine_indexes}

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               engine_idx: int = 0) -> None:
        engine = self.engines[engine_idx]
        if scheduler_stats is not None:
            if not engine.cache_config_logged:
                self._log_cache_config(engine, scheduler_stats.kv_total_blocks)
            engine.record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            engine.record_iteration(iteration_stats)

    def _log_cache_config(self, engine: _EngineMetrics, num_blocks: int) -> None:
        """vLLM's ``vllm:cache_config_info``: a gauge at 1 whose labels are the cache settings, with
        the number of blocks the engine made (known from its first snapshot, which it sends at start)."""
        info = {field.name: str(getattr(self._cache_config, field.name))
                for field in dataclasses.fields(self._cache_config)}
        info.update(num_gpu_blocks=str(num_blocks), engine=engine.labels["engine"])
        if self._cache_config_info is None:
            self._cache_config_info = Gauge("vllm:cache_config_info", "The KV cache's settings (its labels).",
                                            labelnames=list(info), registry=self.registry)
        self._cache_config_info.labels(**info).set(1)
        engine.cache_config_logged = True

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class _EngineMetrics:
    """One engine's series of every family (the families are made with the first engine's)."""

    def __init__(self, registry: CollectorRegistry, families: dict, labels: dict[str, str]) -> None:
        self.labels = labels
        self.cache_config_logged = False

        def make(kind, name: str, documentation: str, **kwargs):
            if name not in families:
                families[name] = kind(name, documentation, labelnames=list(labels), registry=registry, **kwargs)
            return families[name].labels(**labels)

        self.num_requests_running = make(Gauge, "vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = make(Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = make(Gauge, "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.prefix_cache_queries = make(Counter, "vllm:prefix_cache_queries",
                                         "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = make(Counter, "vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.num_preemptions = make(Counter, "vllm:num_preemptions", "Requests preempted.")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Generated tokens.")
        self.iteration_tokens = make(Histogram, "vllm:iteration_tokens_total",
                                     "Tokens a step gave out: prompts of first tokens, and generated tokens.",
                                     buckets=_ITERATION_TOKEN_BUCKETS)
        self.time_to_first_token = make(Histogram, "vllm:time_to_first_token_seconds",
                                        "Time from arrival to the first token.", buckets=_TTFT_BUCKETS)
        self.inter_token_latency = make(Histogram, "vllm:inter_token_latency_seconds",
                                        "Time between two tokens of a request.", buckets=_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = make(Histogram, "vllm:request_time_per_output_token_seconds",
                                          "A finished request's mean time per output token after the first.",
                                          buckets=_TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = make(Histogram, "vllm:e2e_request_latency_seconds",
                                "Time from arrival to the end.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.queue_time = make(Histogram, "vllm:request_queue_time_seconds",
                               "Time from the queue to the first scheduling.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.prefill_time = make(Histogram, "vllm:request_prefill_time_seconds",
                                 "Time from the first scheduling to the first token.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.decode_time = make(Histogram, "vllm:request_decode_time_seconds",
                                "Time from the first token to the last.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.inference_time = make(Histogram, "vllm:request_inference_time_seconds",
                                   "Time from the first scheduling to the last token.",
                                   buckets=_REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = make(Histogram, "vllm:request_prompt_tokens",
                                          "Prompt tokens of finished requests.", buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = make(Histogram, "vllm:request_generation_tokens",
                                              "Generated tokens of finished requests.", buckets=_TOKEN_BUCKETS)
        self.request_max_tokens = make(Histogram, "vllm:request_params_max_tokens",
                                       "The max_tokens of finished requests.", buckets=_TOKEN_BUCKETS)
        self.request_n = make(Histogram, "vllm:request_params_n", "The n of finished requests.", buckets=_N_BUCKETS)
        self.request_max_num_generation_tokens = make(
            Histogram, "vllm:request_max_num_generation_tokens",
            "The generated tokens of a finished request's longest sequence.", buckets=_TOKEN_BUCKETS)
        if "vllm:request_success" not in families:
            families["vllm:request_success"] = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                                       labelnames=[*labels, "finished_reason"], registry=registry)
        # Every reason from the start, as vLLM's: a rate over a reason not seen yet is 0, not absent.
        self.request_success = {reason: families["vllm:request_success"].labels(**labels, finished_reason=reason)
                                for reason in _FINISH_REASONS}

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_stats.queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_stats.hits)
        self.num_preemptions.inc(stats.num_preempted_reqs)

    def record_iteration(self, stats: IterationStats) -> None:
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_prompt_tokens or stats.num_generation_tokens:  # a step that gave tokens out
            self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for seconds in stats.time_to_first_tokens:
            self.time_to_first_token.observe(seconds)
        for seconds in stats.inter_token_latencies:
            self.inter_token_latency.observe(seconds)
        for n, max_num_generation_tokens in zip(stats.n_params, stats.max_num_generation_tokens):
            self.request_n.observe(n)
            self.request_max_num_generation_tokens.observe(max_num_generation_tokens)
        for finished in stats.finished_requests:
            self.request_success[finished.finish_reason].inc()
            self.e2e_latency.observe(finished.e2e_latency)
            self.queue_time.observe(finished.queued_time)
            self.prefill_time.observe(finished.prefill_time)
            self.decode_time.observe(finished.decode_time)
            self.inference_time.observe(finished.inference_time)
            self.time_per_output_token.observe(finished.mean_time_per_output_token)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.max_tokens_param is not None:
                self.request_max_tokens.observe(finished.max_tokens_param)
