"""The request lifecycle: validate and tokenize, add, step, abort; outputs through the OutputProcessor.

The ``LLMEngine`` wires the layers together once (model, KV cache sizing, scheduler) and then runs the
step loop: plan -> execute -> update. It owns no scheduling or device logic itself.

With async scheduling (the default) each step launches its plan and then applies the results of the
step before it, so the host plans step N+1 while the device still runs step N.

A step that raises, wherever and whatever (KeyboardInterrupt included), fails every unfinished
request, as vLLM fails the requests of an engine that dies; unlike vLLM's, this engine then goes on
as a fresh one would (``abort_all_requests``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from micro_vllm.config import LLMConfig
from micro_vllm.core.kv_cache_manager import KVCacheManager, make_kv_cache_groups, max_blocks_per_request
from micro_vllm.core.request import Request, RequestStatus
from micro_vllm.core.scheduler import Scheduler
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.engine.output_processor import OutputProcessor
from micro_vllm.engine.parallel_sampling import ParentRequest
from micro_vllm.engine.request_output import RequestOutput
from micro_vllm.executor.abstract import Executor
from micro_vllm.executor.multiproc_executor import MultiprocExecutor
from micro_vllm.executor.single_process import SingleProcessExecutor
from micro_vllm.layers.rotary import max_rope_position
from micro_vllm.metrics.stats import IterationStats, SchedulerStats
from micro_vllm.model_loader.checkpoint import default_sampling_overrides, load_hf_config, resolve_model_path
from micro_vllm.models.registry import get_model_class
from micro_vllm.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from micro_vllm.sampling.params import SamplingParams, bad_words_token_ids
from micro_vllm.tokenizer import load_tokenizer
from micro_vllm.trace.events import RunInfo
from micro_vllm.trace.tracer import Tracer, resolve_trace
from micro_vllm.validation import is_int, reject, short_repr

if TYPE_CHECKING:
    from micro_vllm.engine.arg_utils import EngineArgs
    from micro_vllm.structured_output.manager import StructuredOutputManager

PromptType = Union[str, list[int], dict[str, Any]]


class LLMEngine:
    """vLLM's ``LLMEngine``: ``add_request(request_id, prompt, params)``, then ``step()`` while
    ``has_unfinished_requests()``, each step returning the ``RequestOutput``s it made.

    With ``log_stats`` (vLLM's setting) the steps and aborts also time each request's tokens and
    phases into an ``IterationStats`` that ``take_iteration_stats()`` hands out."""

    def __init__(self, config: LLMConfig, log_stats: bool = True) -> None:
        self.config = config
        self.iteration_stats: IterationStats | None = IterationStats() if log_stats else None
        trace_config = resolve_trace(config.trace)  # a bad trace setting fails before any loading
        model_config = config.model_config
        path = resolve_model_path(model_config.model)
        hf_config = load_hf_config(path, model_config.hf_overrides)
        # Fail on an unsupported architecture, or heads that do not split over the ranks, before any
        # loading or process starts.
        get_model_class(hf_config).verify_tensor_parallel_size(hf_config, config.parallel_config.tensor_parallel_size)
        self.max_model_len = _resolve_max_model_len(config, hf_config)
        self.vocab_size = hf_config.vocab_size
        self.tokenizer = load_tokenizer(path, model_config.tokenizer)
        self.eos_token_ids = _eos_token_ids(path, hf_config, self.tokenizer)
        # The SamplingParams fields the model recommends (LLM.get_default_sampling_params).
        self.default_sampling_overrides = default_sampling_overrides(path, model_config.generation_config)

        executor_cls = _executor_class(config.parallel_config.distributed_executor_backend)
        self.executor: Executor = executor_cls(config, path, hf_config, self.max_model_len)
        try:
            groups = make_kv_cache_groups(self.executor.get_attention_specs())
            self.num_blocks = self.executor.determine_num_blocks(max_blocks_per_request(
                groups, self.max_model_len, config.scheduler_config.max_num_batched_tokens, config.cache_config.block_size
            ))
            self.executor.initialize_kv_cache(groups, self.num_blocks)
        except BaseException:
            self.executor.shutdown()  # a failed start leaves no worker process behind
            raise
        self.tracer = Tracer(trace_config) if trace_config is not None else None
        cache_config = config.cache_config
        kv_cache_manager = KVCacheManager(
            groups, self.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            block_listener=self.tracer.block_listener if self.tracer is not None else None,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.max_model_len, kv_cache_manager)
        self.structured_output_manager: StructuredOutputManager | None = None  # built for the first such request
        self.in_flight: deque[AsyncModelRunnerOutput] = deque()
        self._in_step = False  # set while a step or its rollback runs; still set if a rollback was cut short
        self.prompts: dict[str, str | None] = {}  # made requests' prompt texts, until they are added
        self.output_processor = OutputProcessor(self.tokenizer)
        if self.tracer is not None:
            self.tracer.record_start(self._run_info(), self.scheduler.stats)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's way to build the engine: from flat settings (``EngineArgs``)."""
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats)

    # -- requests ------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> Request:
        """Validate and tokenize one prompt; raises before anything is queued."""
        if not isinstance(request_id, str):
            raise reject("request_id", request_id, "a string", TypeError)
        if not isinstance(params, SamplingParams):
            raise reject("sampling_params", params, "a SamplingParams", TypeError)
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError(f"prompt {short_repr(prompt)} is empty; give at least one token")
        self._check_vocabulary("prompt_token_ids", token_ids)
        self._check_vocabulary("logit_bias", params.logit_bias or ())
        self._check_vocabulary("allowed_token_ids", params.allowed_token_ids or ())
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name}={list(getattr(params, name))!r} is not allowed: this model has no tokenizer")
        self._check_num_logprobs(params)
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError(f"structured_outputs={params.structured_outputs!r} is not allowed: this model has no "
                             "tokenizer to map the constraint to token ids")
        if params.structured_outputs is not None and not self.eos_token_ids:
            raise ValueError(f"structured_outputs={params.structured_outputs!r} is not allowed: this model has no EOS "
                             "token id to end a constrained output (generation_config.json, config.json and the "
                             "tokenizer give none)")
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer) if params.bad_words else ()
        self._check_vocabulary("bad_words", [t for word in bad_words for t in word])
        request = Request(request_id, token_ids, params, self.eos_token_ids, bad_words_token_ids=bad_words)
        self.scheduler.check_fits(request)
        self.prompts[request_id] = text
        return request

    def add_request(self, request_id: str, prompt: PromptType | Request, params: SamplingParams | None = None) -> None:
        """Queue a prompt (vLLM's signature), or a request ``make_request`` made from one (checked
        before anything was queued; ``params`` is then the request's own and may be left out). One
        with ``n > 1`` runs as ``n`` child requests (``parallel_sampling.py``) that give one output
        together. A structured-output request's grammar is compiled here unless the request has it
        already (the engine's process compiles it in the background first, ``core_proc.py``); each
        child gets a matcher of its own."""
        if not isinstance(prompt, Request):
            prompt = self.make_request(request_id, prompt, params)
        elif prompt.request_id != request_id:
            raise ValueError(f"request_id={request_id!r} is not the id of the request it was made with "
                             f"({prompt.request_id!r})")
        request = prompt
        self._finish_rollback()
        parent = ParentRequest(request) if request.sampling_params.n > 1 else None
        requests = parent.children if parent is not None else [request]
        ids = [request.request_id] + ([r.request_id for r in requests] if parent is not None else [])
        for request_id in ids:
            if request_id in self.scheduler.requests or request_id in self.output_processor.parent_requests:
                raise ValueError(f"request_id={request_id!r} is already in use")
        for child in requests:
            constraint = child.sampling_params.structured_outputs
            if child.grammar is None and constraint is not None:
                child.grammar = self.get_structured_output_manager().grammar_init(constraint)
        prompt = self.prompts.pop(request.request_id, None)
        now = time.monotonic()
        for index, child in enumerate(requests):
            self.output_processor.add_request(child, prompt, parent, index, queued_ts=now)
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish requests (one id, or several as vLLM passes them) wherever they are and free their
        blocks; a request with ``n > 1`` with all its sequences. Returns the final outputs
        (``finish_reason="abort"``) of those that were unfinished; unknown or finished ids are skipped,
        and other requests are untouched."""
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.output_processor.parent_requests.get(request_id)
            children = [child.request_id for child in parent.children] if parent is not None else [request_id]
            aborted = self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            if not aborted:
                continue
            if self.tracer is not None:
                self.tracer.record_abort(request_id, self.scheduler.make_stats())
            finished = self.output_processor.finish(aborted, self.iteration_stats, time.monotonic())
            outputs += self.output_processor.gather(finished, self.iteration_stats)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's name); None for a model without one."""
        return self.tokenizer

    @property
    def last_step_stats(self) -> SchedulerStats:
        """The snapshot the scheduler made with the last plan: the queues and KV cache while that
        step's blocks were held, its prefill and decode tokens, prefix-cache hits, preemptions."""
        return self.scheduler.stats

    def take_iteration_stats(self) -> IterationStats | None:
        """What the steps and aborts since the last call gave out (None without ``log_stats``)."""
        stats = self.iteration_stats
        if stats is not None:
            self.iteration_stats = IterationStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # -- the step loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launch one step and apply the results that are due; return the outputs they make: one for
        each request that finished, and one for each streaming request (``output_kind`` CUMULATIVE or
        DELTA) that got new tokens.

        If anything raises inside the step, every unfinished request is aborted without an output
        (``abort_all_requests``) and the exception propagates; the engine stays usable."""
        self._finish_rollback()
        self._in_step = True
        try:
            if self.tracer is not None:
                outputs = self._traced_step(self.tracer)
            else:
                outputs = self._execute(self.scheduler.schedule())
        except BaseException:
            self.abort_all_requests()
            raise
        self._in_step = False
        return outputs

    def abort_all_requests(self) -> None:
        """Abort every unfinished request, discard the steps in flight, and forget the prefix-cache
        hashes of every step whose output was not applied (its K/V may never have been computed);
        the runner forgets every request too. What a failed step does: afterwards nothing runs,
        every KV block is free, and the engine gives a fresh engine's outputs."""
        # Nothing ran since the last step completed, and the runner holds no request the next plan
        # would have told it to drop: nothing to roll back. Otherwise _in_step stays set until the
        # rollback is done, so that one cut short (a second Ctrl-C) is finished by the next call.
        self._in_step = bool(self._in_step or self.in_flight or self.scheduler.has_unfinished_requests()
                             or self.scheduler.finished_req_ids)
        self.prompts.clear()
        self.output_processor.clear()
        if not self._in_step:
            return
        self.in_flight.clear()
        aborted = self.scheduler.reset()
        self.executor.reset_batch()
        self._in_step = False
        if self.tracer is not None:
            stats = self.scheduler.make_stats()
            for request in aborted:
                self.tracer.record_abort(request.request_id, stats)

    def shutdown(self) -> None:
        """Release the executor; a trace ends with the KV cache as it is left (its ``end`` event)."""
        try:
            self.executor.shutdown()
        finally:
            if self.tracer is not None:
                self.tracer.close(self.scheduler.make_stats())
                self.tracer = None

    # -- helpers -------------------------------------------------------------------------------

    def _check_vocabulary(self, name: str, token_ids: Iterable[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{name} contain {bad[:5]} outside the vocabulary; allowed ids are 0..{self.vocab_size - 1}"
            )

    def _finish_rollback(self) -> None:
        """Roll back a step whose rollback was itself interrupted (a second Ctrl-C, say)."""
        if self._in_step:
            self.abort_all_requests()

    def get_structured_output_manager(self) -> StructuredOutputManager:
        """The engine's one manager, built with the first structured-output request (loading xgrammar)."""
        if self.structured_output_manager is None:
            from micro_vllm.structured_output.manager import StructuredOutputManager

            self.structured_output_manager = StructuredOutputManager(
                self.tokenizer, self.vocab_size, self.config.scheduler_config.max_num_seqs, self.eos_token_ids
            )
            self.scheduler.structured_output_manager = self.structured_output_manager
        return self.structured_output_manager

    def _execute(self, plan: SchedulerOutput) -> list[RequestOutput]:
        if self.iteration_stats is not None and plan.scheduled_new_reqs:
            self.output_processor.record_scheduled((new.req_id for new in plan.scheduled_new_reqs), time.monotonic())
        self.in_flight.append(self.executor.execute_model(plan))
        # Async: the step just launched stays in flight unless it is empty or nothing is left to wait
        # for, or it samples under a grammar: the next plan's bitmask needs this step's tokens accepted.
        keep = 1 if (self.config.scheduler_config.async_scheduling and not plan.is_empty
                     and not plan.structured_output_request_ids) else 0
        outputs = []
        while self.in_flight and (len(self.in_flight) > keep or not self.scheduler.has_unfinished_requests()):
            outputs += self._apply(self.in_flight.popleft().get_output())
        return outputs

    def _apply(self, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply one step's sampled tokens: the scheduler ends requests at stop tokens and lengths,
        the output processor at stop strings, and the outputs are made."""
        finished = self.scheduler.update_from_output(runner_output)
        if runner_output.logprobs or runner_output.prompt_logprobs_dict:
            self.output_processor.update_logprobs(runner_output.logprobs, runner_output.prompt_logprobs_dict)
        outputs, stopped = self.output_processor.process_step(runner_output.req_ids)
        finished += self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        now = time.monotonic()
        if self.iteration_stats is not None:
            self.output_processor.update_stats(runner_output.req_ids, self.iteration_stats, now)
        outputs += self.output_processor.finish(finished, self.iteration_stats, now)
        return self.output_processor.gather(outputs, self.iteration_stats)

    def _traced_step(self, tracer: Tracer) -> list[RequestOutput]:
        started = tracer.clock()
        plan = self.scheduler.schedule()
        stats = self.scheduler.stats  # made with the plan, while this step's blocks are held
        outputs = self._execute(plan)
        tracer.record_step(plan, stats, started, [o.request_id for o in outputs if o.finished])
        return outputs

    def _run_info(self) -> RunInfo:
        """The settings a trace reader needs to make sense of the steps."""
        config = self.config
        return RunInfo(
            model=config.model_config.model,
            block_size=config.cache_config.block_size,
            enable_prefix_caching=config.cache_config.enable_prefix_caching,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            max_num_seqs=config.scheduler_config.max_num_seqs,
        )

    def _check_num_logprobs(self, params: SamplingParams) -> None:
        """vLLM's cap on ``logprobs`` and ``prompt_logprobs``: ``ModelConfig.max_logprobs`` (-1 in either
        meaning the whole vocabulary), and never more than the vocabulary."""
        max_logprobs = self.config.model_config.max_logprobs
        limit = self.vocab_size if max_logprobs == -1 else min(max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and (self.vocab_size if value == -1 else value) > limit:
                whole = ", or -1 (the whole vocabulary)" if limit == self.vocab_size else ""
                raise reject(name, value, f"None or an integer in [0, {limit}]{whole}: ModelConfig.max_logprobs is "
                             f"{max_logprobs} and the vocabulary has {self.vocab_size} tokens")

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as ids only) and its token ids, each of its parts checked."""
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise reject("prompt", text, "a string", TypeError)
            if "prompt_token_ids" in prompt:
                return text, _token_ids(prompt["prompt_token_ids"])
            if text is None:
                raise reject("prompt", prompt, "a dict with 'prompt_token_ids' or 'prompt'")
            prompt = text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but this model has no tokenizer; pass prompt_token_ids instead")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        if isinstance(prompt, _TOKEN_ID_SEQUENCES):
            return None, _token_ids(prompt)
        raise reject("prompt", prompt, _PROMPT_FORMS, TypeError)


_PROMPT_FORMS = "a string, a list of token ids, or a dict with 'prompt_token_ids' or 'prompt'"
_TOKEN_ID_SEQUENCES = (list, tuple, np.ndarray)


def _token_ids(value: object) -> list[int]:
    """A prompt's token ids as Python ints: a list, tuple or 1-D array of integers, never of bools."""
    if not isinstance(value, _TOKEN_ID_SEQUENCES) or getattr(value, "ndim", 1) != 1:
        raise reject("prompt_token_ids", value, "a list of integer token ids (not bools)", TypeError)
    # Long prompts are checked id by id, so the usual forms take the checks that cost least:
    # an integer array's dtype, or ints that are exactly ``int`` (a bool's type is bool).
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        return value.tolist()
    if all(type(t) is int for t in value):
        return list(value)
    if not all(is_int(t) for t in value):
        raise reject("prompt_token_ids", value, "a list of integer token ids (not bools)", TypeError)
    return [int(t) for t in value]


def _resolve_max_model_len(config: LLMConfig, hf_config) -> int:
    model_limit = max_rope_position(hf_config)
    requested = config.scheduler_config.max_model_len
    if requested is None:
        if model_limit is None:
            raise ValueError("max_model_len must be given: the model config has no max_position_embeddings")
        config.scheduler_config.verify_max_model_len(model_limit)  # a given one was checked on construction
        return model_limit
    if model_limit is not None and requested > model_limit:
        raise ValueError(
            f"max_model_len={requested} is not allowed; this model supports at most {model_limit} tokens"
        )
    return requested


def _executor_class(backend: str) -> type[Executor]:
    """The executor of ``backend``, as ParallelConfig picked it: "uni" runs the one rank in this
    process, "mp" a process per rank, "ray" a Ray actor per rank (ParallelConfig refuses it without Ray)."""
    if backend == "ray":
        from micro_vllm.executor.ray_distributed_executor import RayDistributedExecutor  # Ray is optional

        return RayDistributedExecutor
    return MultiprocExecutor if backend == "mp" else SingleProcessExecutor


def _eos_token_ids(path: Path, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (which may list several), else the model config or
    the tokenizer."""
    generation_config = path / "generation_config.json"
    eos = None
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
