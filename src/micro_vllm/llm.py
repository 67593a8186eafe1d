"""The offline API: prompts in, RequestOutputs out, with a progress bar."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Sequence

from tqdm.auto import tqdm

from micro_vllm.config import LLMConfig
from micro_vllm.engine.arg_utils import engine_args_from_kwargs
from micro_vllm.engine.engine import LLMEngine, PromptType
from micro_vllm.engine.request_output import RequestOutput
from micro_vllm.metrics.loggers import PrometheusStatLogger
from micro_vllm.metrics.reader import Metric, get_metrics_snapshot
from micro_vllm.sampling.params import RequestOutputKind, SamplingParams
from micro_vllm.utils import heap_frozen, sigint_held_back
from micro_vllm.validation import reject, short_repr


class LLM:
    """Generate text with a model, vLLM style.

    ``LLM(model=path, max_model_len=..., block_size=..., ...)`` takes every ``EngineArgs`` setting
    by name (the model may also come first, unnamed; none: the default model), or ``LLM(LLMConfig(...))``
    the grouped configs. ``disable_log_stats=False`` records the metrics ``get_metrics()`` returns
    (off by default, as in vLLM's ``LLM``).

    ``seed`` seeds the engine's own random generators (the sampler's, and dummy weights'), never the
    global ones of Python's ``random``, numpy or torch: vLLM seeds those in its worker process, which
    in vLLM's default multiprocessing mode is not the user's, whereas this engine runs in the caller's
    process, where reseeding them would change the caller's own random streams. Sampling with a seed
    is reproducible without them: an unseeded request draws from the engine's generator, and a
    ``SamplingParams.seed`` gives a request its own.
    """

    def __init__(self, config: LLMConfig | str | None = None, *, model: str | None = None,
                 disable_log_stats: bool = True, **kwargs: Any) -> None:
        if isinstance(config, str) and model is None:  # LLM("path/or/hub-id", ...), as in vLLM
            config, model = None, config
        if config is None:
            config = engine_args_from_kwargs("LLM", {"model": model, **kwargs}).create_engine_config()
        elif not isinstance(config, LLMConfig):
            raise reject("config", config, "an LLMConfig or a model path (str)", TypeError)
        elif model is not None or kwargs:
            raise TypeError("give LLM either an LLMConfig or keywords, not both")
        if config.parallel_config.data_parallel_size > 1:
            replicas = config.parallel_config.data_parallel_size
            raise reject("data_parallel_size", replicas, f"1 for LLM, which runs one engine: serve {replicas} "
                         f"replicas behind one server with `micro-vllm serve --data-parallel-size {replicas}`, "
                         "or start one LLM per replica")
        self.config = config
        self.engine: LLMEngine | None = LLMEngine(config, log_stats=not disable_log_stats)
        self.stat_logger = None if disable_log_stats else PrometheusStatLogger(config.model_config.model,
                                                                               config.cache_config)
        self._request_counter = itertools.count()
        # One generate() at a time: calls from several threads wait for each other.
        self._generate_lock = threading.Lock()
        self._generating_thread: int | None = None
        self._shutdown_requested = False
        # abort_request may come from another thread while generate() runs; generate() applies the
        # aborts between steps, so the engine itself is only ever touched by generate's thread.
        self._abort_lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._pending_aborts: list[str] = []

    @property
    def tokenizer(self):
        return self._engine().tokenizer

    def get_tokenizer(self):
        """vLLM's name for ``tokenizer``."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none, as vLLM's
        ``generation_config="auto"`` makes them: ``SamplingParams()`` with the fields the model's
        ``generation_config.json`` sets among temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens (as max_tokens). ``generation_config="vllm"`` leaves ``SamplingParams()``'s own."""
        return SamplingParams(**self._engine().default_sampling_overrides)

    def get_metrics(self) -> list[Metric]:
        """The metrics recorded so far, as vLLM's metrics reader gives them (``micro_vllm.metrics.reader``:
        ``Counter``, ``Gauge`` and ``Histogram``, under vLLM's ``vllm:`` names): the scheduler's
        figures at every step (requests running and waiting, KV cache usage, prefix cache queries and
        hits, preemptions), the tokens each step gave out with their latencies (time to first token,
        inter-token latency) and each finished sequence's (finish reason, prompt and generated tokens,
        time queued, prefilling, decoding, end to end), as the server's ``/metrics`` gives them.

        Needs ``LLM(..., disable_log_stats=False)``: as in vLLM, an ``LLM`` records no metrics by default."""
        if self.stat_logger is None:
            raise RuntimeError("this LLM records no metrics; build it with disable_log_stats=False to use get_metrics()")
        return get_metrics_snapshot(self.stat_logger.registry)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order, each holding its
        ``SamplingParams.n`` sequences by index. Without ``sampling_params``, every prompt takes
        ``get_default_sampling_params()``.

        All prompts are checked before any is queued, so a bad one raises without touching the others.
        If anything raises once they run (an error in a step, a KeyboardInterrupt, ``shutdown()``
        from another thread), every request of the call is aborted and the error propagates; outputs
        of the call are lost, and the LLM stays usable: the same prompts then give the same tokens
        as in a fresh LLM. Calls from several threads run one after another.
        """
        if self._inside_generate():
            raise RuntimeError("generate() was called from inside generate() (a callback); call it once that returns")
        with self._generate_lock:
            engine = self._engine()
            try:
                self._generating_thread = threading.get_ident()
                if engine.has_unfinished_requests() or engine.in_flight:
                    engine.abort_all_requests()  # left by a call whose rollback a second Ctrl-C kept from starting
                # The caller's heap and the engine's are out of the collector's scans while the steps
                # run, and back in after: the server's engine process freezes its own for good.
                with heap_frozen():
                    return self._generate(engine, prompts, sampling_params, use_tqdm)
            except BaseException:
                engine.abort_all_requests()  # this call's requests are all the engine holds
                raise
            finally:
                self._generating_thread = None
                with self._abort_lock:
                    self._in_flight.clear()
                    self._pending_aborts.clear()
                if self._shutdown_requested:
                    self._close()

    def _generate(self, engine: LLMEngine, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        requests = [engine.make_request(str(next(self._request_counter)), p, sp) for p, sp in zip(prompts, params)]
        for request in requests:
            engine.add_request(request.request_id, request)
        order = {r.request_id: i for i, r in enumerate(requests)}
        with self._abort_lock:
            self._in_flight = set(order)
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = None
        try:
            if use_tqdm:
                # tqdm takes its process-wide lock in Python without a try (a Ctrl-C inside would leave
                # it held, and every later bar waiting for it), and a KeyboardInterrupt raised in its
                # __del__ is lost (Python ignores exceptions in finalizers): its calls hold Ctrl-C back.
                with sigint_held_back():
                    bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True)
            prefill_tokens = decode_tokens = 0
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                if self._shutdown_requested:
                    raise RuntimeError("LLM.shutdown() was called while generate() ran; its requests were aborted")
                outputs = self._apply_aborts(engine)
                scheduler_stats = None
                if engine.has_unfinished_requests():
                    outputs += engine.step()
                    scheduler_stats = engine.last_step_stats
                    prefill_tokens += scheduler_stats.num_prefill_tokens
                    decode_tokens += scheduler_stats.num_decode_tokens
                if self.stat_logger is not None:
                    self.stat_logger.record(scheduler_stats, engine.take_iteration_stats())
                for output in outputs:
                    results[order[output.request_id]] = output
                with self._abort_lock:
                    self._in_flight.difference_update(out.request_id for out in outputs)
                if bar is not None:
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                                        f"decode {decode_tokens / elapsed:.0f} tok/s", refresh=False)
                    if outputs:
                        with sigint_held_back():
                            bar.update(len(outputs))
        finally:
            if bar is not None:
                with sigint_held_back():
                    bar.close()
                    bar = None  # tqdm's __del__ runs now, where it cannot swallow a Ctrl-C
        if self.stat_logger is not None:  # the gauges as the engine is left: idle
            self.stat_logger.record(engine.scheduler.make_stats(), None)
        return results

    def abort_request(self, request_id: str) -> bool:
        """Abort one of this LLM's requests while ``generate`` runs it.

        ``generate`` blocks, so call this from another thread or from a callback that runs during it
        (a trace sink's ``emit``, say). The abort takes effect before the next step: ``generate``
        returns that request's output with ``finish_reason="abort"`` and the tokens generated so far,
        its KV blocks are freed, and the other requests go on unchanged. Request ids are "0", "1", ...
        in the order this LLM received the prompts, over all calls (``RequestOutput.request_id``).

        Returns True when the abort is queued (a request that finishes in the step under way keeps its
        own finish reason), False when the request is not running: unknown, already finished, or no
        ``generate`` in progress; nothing happens then.
        """
        with self._abort_lock:
            if request_id not in self._in_flight:
                return False
            self._in_flight.discard(request_id)
            self._pending_aborts.append(request_id)
            return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, as vLLM's ``LLM.reset_prefix_cache`` does: later
        requests compute their prompts in full (a benchmark that must not hit an earlier run's
        cache, say). Call it between ``generate`` calls, when no request holds KV blocks; otherwise
        it changes nothing and returns False. Called while another thread's ``generate`` runs, it
        waits for that call to end."""
        if self._inside_generate():
            return False  # the running call's requests hold blocks
        with self._generate_lock:
            return self._engine().reset_prefix_cache()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, each rendered with a chat template (vLLM's options):
        ``chat_template`` (a Jinja template, as a string) or else the tokenizer's. The prompt ends
        with the start of an assistant turn (``add_generation_prompt``), or, with
        ``continue_final_message`` (and ``add_generation_prompt=False``), with the last message left
        open, so that the reply continues it. ``chat_template_kwargs`` are more variables for the
        template (such as Qwen3's ``enable_thinking``)."""
        conversations = _as_conversations(messages)
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True is not allowed with add_generation_prompt=True: the reply "
                             "either continues the last message or starts a new one; pass add_generation_prompt=False")
        if chat_template_kwargs is not None and not (
            isinstance(chat_template_kwargs, dict) and all(isinstance(key, str) for key in chat_template_kwargs)
        ):
            raise reject("chat_template_kwargs", chat_template_kwargs, "None or a dict with string keys", TypeError)
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer to render a chat; use generate() with token ids")
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError("this model has no chat template; pass chat_template=... or use generate()")
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}),
            )
            # The template already holds any special tokens: encoding must not add them again.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        """Release the engine. A ``generate`` running in another thread stops before its next step
        with a RuntimeError (its requests aborted) and shutdown waits for that; called from inside
        ``generate`` (a callback), it takes effect when that call ends."""
        self._shutdown_requested = True
        if self._inside_generate():
            return
        with self._generate_lock:
            self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _apply_aborts(self, engine: LLMEngine) -> list[RequestOutput]:
        """Abort what abort_request queued since the last step; return those requests' outputs."""
        with self._abort_lock:
            aborts, self._pending_aborts = self._pending_aborts, []
        return engine.abort_request(aborts)

    def _inside_generate(self) -> bool:
        """Whether this thread runs ``generate`` (and calls in from a callback)."""
        return self._generating_thread == threading.get_ident()

    def _close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _engine(self) -> LLMEngine:
        if self.engine is None or self._shutdown_requested:
            raise RuntimeError("this LLM was shut down")
        return self.engine


_PROMPTS = "a prompt (a string, a list of token ids, or a dict) or a list of prompts"
_MESSAGE = "{'role': str, 'content': str}"
_CONVERSATIONS = f"a conversation (a list of {_MESSAGE} dicts) or a list of conversations"


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise reject("prompts", prompts, _PROMPTS, TypeError)
    prompts = list(prompts)
    # One prompt given as token ids; bools count here so that the engine refuses them by name.
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]
    return prompts


def _as_params_list(sampling_params, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, each with ``output_kind=FINAL_ONLY`` (as in vLLM's
    ``LLM.generate``: it returns finished outputs only, so nothing needs streaming)."""
    if isinstance(sampling_params, SamplingParams):
        return [_final_only(sampling_params)] * n
    if isinstance(sampling_params, (str, bytes, Mapping)) or not isinstance(sampling_params, Iterable):
        raise reject("sampling_params", sampling_params, "a SamplingParams or a list of them", TypeError)
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(
            f"sampling_params has {len(params)} entries for {n} prompts; give one SamplingParams or one per prompt"
        )
    final_only = {id(p): _final_only(p) for p in params if isinstance(p, SamplingParams)}  # once per object
    return [final_only.get(id(p), p) for p in params]  # the engine names what is not a SamplingParams


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _as_conversations(messages) -> list[list[dict[str, str]]]:
    """One conversation or a list of them, each message a dict of a string role and content."""
    if not isinstance(messages, (list, tuple)):
        raise reject("messages", messages, _CONVERSATIONS, TypeError)
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    for conversation in conversations:
        if not isinstance(conversation, (list, tuple)):
            raise reject("messages", messages, _CONVERSATIONS, TypeError)
        for message in conversation:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise TypeError(f"messages contain {short_repr(message)}; each message must be a {_MESSAGE} dict")
    return list(conversations)
