"""From the scheduler's requests to the user's ``RequestOutput``s: text, stop strings, streaming.

Each request has a ``RequestState`` (vLLM's name). One that streams (``output_kind`` CUMULATIVE or
DELTA) or has stop strings gets an ``IncrementalDetokenizer``, fed each step's new tokens: a stop
string it finds ends the request, and a streaming request gets an output at every step that gives
it tokens. A FINAL_ONLY request without stop strings is decoded once when it finishes, to the same
text (see ``decode_output``), so the default path does no work per step. A request that asks for
logprobs or prompt logprobs has a ``LogprobsProcessor`` fed each step's rows (``update_logprobs``).

A request with ``n > 1`` is a ``ParentRequest`` (``parallel_sampling.py``) whose children each have a
state here; ``gather`` turns a step's outputs of its children into one output of the parent.

Given an ``IterationStats``, each state's ``RequestStateStats`` times the request's tokens as the
steps give them (``update_stats``), and ``finish`` and ``gather`` add each finished request to it, as
vLLM's output processor does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from micro_vllm.core.request import Request, RequestStatus
from micro_vllm.engine.detokenizer import IncrementalDetokenizer, decode_output
from micro_vllm.engine.logprobs import LogprobsProcessor
from micro_vllm.engine.parallel_sampling import ParentRequest
from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
from micro_vllm.metrics.stats import IterationStats, RequestStateStats
from micro_vllm.outputs import LogprobsLists
from micro_vllm.sampling.params import RequestOutputKind


class RequestState:
    """One request's side of the outputs: its prompt text, its detokenizer (if it needs one per
    step) and how much of it the DELTA outputs have given out. ``index`` is its sequence's index
    among its parent's (0 without a parent)."""

    def __init__(self, request: Request, prompt: str | None, tokenizer, token_texts: dict[int, str],
                 index: int = 0, queued_ts: float = 0.0) -> None:
        params = request.sampling_params
        self.request = request
        self.stats = RequestStateStats(request.arrival_time, queued_ts)
        self.index = index
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.output_kind = params.output_kind
        self.detokenizer: IncrementalDetokenizer | None = None
        if params.stop or self.output_kind is not RequestOutputKind.FINAL_ONLY:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                detokenize=params.detokenize, min_tokens=params.min_tokens,
            )
        self.num_sent_tokens = 0  # output tokens the DELTA outputs have given out
        self.logprobs_processor: LogprobsProcessor | None = None
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.logprobs_processor = LogprobsProcessor(tokenizer, params, token_texts)

    def update(self) -> str | None:
        """Feed the detokenizer the request's new tokens; return the stop string it found, if any."""
        request, detokenizer = self.request, self.detokenizer
        new_token_ids = request.all_token_ids[request.num_prompt_tokens + len(detokenizer.token_ids):]
        return detokenizer.update(new_token_ids, stop_terminated=request.status == RequestStatus.FINISHED_STOPPED)

    def make_output(self) -> RequestOutput:
        request = self.request
        finished = request.is_finished
        delta = self.output_kind is RequestOutputKind.DELTA
        first = 0  # the first output token this output gives
        if self.detokenizer is None:
            token_ids = request.output_token_ids
            text = self._decode_once(token_ids)
        else:
            all_token_ids = self.detokenizer.token_ids
            first = self.num_sent_tokens if delta else 0
            token_ids = all_token_ids[first:]
            self.num_sent_tokens = len(all_token_ids)
            text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = cumulative_logprob = prompt_logprobs = None
        if self.logprobs_processor is not None:
            processor = self.logprobs_processor
            if processor.logprobs is not None:
                logprobs = processor.logprobs[first:]
            cumulative_logprob = processor.cumulative_logprob
            prompt_logprobs = processor.pop_prompt_logprobs() if delta else processor.prompt_logprobs
        # Positional: made for every streaming request at every step, and keywords cost twice the time.
        completion = CompletionOutput(self.index, text, token_ids, cumulative_logprob, logprobs, request.finish_reason,
                                      request.stop_reason)
        return RequestOutput(request.request_id, self.prompt, request.prompt_token_ids, prompt_logprobs, [completion],
                             finished, max(request.num_cached_tokens, 0))

    def _decode_once(self, token_ids: list[int]) -> str:
        params = self.request.sampling_params
        if self.tokenizer is None or not params.detokenize:
            return ""
        if self.request.status == RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
            token_ids = token_ids[:-1]  # the EOS or stop token that ended it is not part of the text
        return decode_output(self.tokenizer, self.request.prompt_token_ids, token_ids,
                             skip_special_tokens=params.skip_special_tokens)


class OutputProcessor:
    """The states of the engine's requests, from ``add_request`` until ``finish`` makes their last output."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}  # token id -> its text alone, for the logprobs (LogprobsProcessor)
        self.states: dict[str, RequestState] = {}
        self.detokenized: dict[str, RequestState] = {}  # the states updated at every step
        self.parent_requests: dict[str, ParentRequest] = {}  # by the parent's id, until all its children finish
        self.parent_of: dict[str, ParentRequest] = {}  # by the child's id

    def add_request(self, request: Request, prompt: str | None, parent_req: ParentRequest | None = None,
                    index: int = 0, queued_ts: float = 0.0) -> None:
        """Track ``request``, queued at ``queued_ts``; a child of ``parent_req`` makes sequence ``index``
        of its parent's outputs."""
        state = RequestState(request, prompt, self.tokenizer, self.token_texts, index, queued_ts)
        self.states[request.request_id] = state
        if state.detokenizer is not None:
            self.detokenized[request.request_id] = state
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
            self.parent_of[request.request_id] = parent_req

    def update_logprobs(self, logprobs: dict[str, LogprobsLists], prompt_logprobs: dict[str, LogprobsLists]) -> None:
        """Give each request's logprobs processor the step's rows (a request that has ended since the
        step was planned is gone, as its token is)."""
        for req_id in logprobs.keys() | prompt_logprobs.keys():
            state = self.states.get(req_id)
            if state is not None:
                state.logprobs_processor.update_from_output(logprobs.get(req_id), prompt_logprobs.get(req_id))

    def process_step(self, req_ids: Iterable[str]) -> tuple[list[RequestOutput], list[str]]:
        """Detokenize the step's new tokens. Returns the outputs of the streaming requests that go
        on, and the ids of the running requests that a stop string ended (the engine finishes them)."""
        if not self.detokenized:
            return [], []
        outputs, stopped = [], []
        for req_id in req_ids:
            state = self.detokenized.get(req_id)
            if state is None:
                continue
            request = state.request
            if request.num_output_tokens == len(state.detokenizer.token_ids):
                continue  # no token this step: a prompt chunk, or dropped after the request ended
            stop = state.update()
            if stop is not None:
                request.stop_reason = stop
                if request.is_finished:  # capped by length in the same step: the stop string came first
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    stopped.append(req_id)
            elif not request.is_finished and state.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(state.make_output())
        return outputs, stopped

    def record_scheduled(self, req_ids: Iterable[str], now: float) -> None:
        """The requests a plan starts (or resumes after preemption): the first time counts."""
        for req_id in req_ids:
            stats = self.states[req_id].stats
            if stats.scheduled_ts == 0.0:
                stats.scheduled_ts = now

    def update_stats(self, req_ids: Iterable[str], iteration_stats: IterationStats, now: float) -> None:
        """Time the tokens the step that ended at ``now`` gave each of ``req_ids`` (a prompt chunk
        gives none)."""
        for req_id in req_ids:
            state = self.states.get(req_id)
            if state is None:
                continue  # ended since the step was planned
            num_new_tokens = state.request.num_output_tokens - state.stats.num_generation_tokens
            if num_new_tokens > 0:
                iteration_stats.update_from_output(state.stats, state.request.num_prompt_tokens, num_new_tokens, now)

    def finish(self, requests: Iterable[Request], iteration_stats: IterationStats | None,
               now: float) -> list[RequestOutput]:
        """The final outputs of finished requests, whose states are then dropped; each finished
        request is added to ``iteration_stats`` (unless None), as finished at ``now``."""
        outputs = []
        for request in requests:
            state = self.states.pop(request.request_id)
            self.detokenized.pop(request.request_id, None)
            outputs.append(state.make_output())
            if iteration_stats is not None:
                iteration_stats.update_from_finished(state.stats, request.finish_reason, request.num_prompt_tokens,
                                                     request.sampling_params.max_tokens, now)
                if request.request_id not in self.parent_of:
                    iteration_stats.update_from_finished_user_request(1, state.stats.num_generation_tokens)
        return outputs

    def gather(self, outputs: list[RequestOutput], iteration_stats: IterationStats | None) -> list[RequestOutput]:
        """One output per request the user added: the outputs of a parent's children, all of one
        step, become the parent's one output (if its output kind gives one now). A parent whose
        children have all finished is added to ``iteration_stats`` (unless None)."""
        if not self.parent_of:
            return outputs
        gathered, by_parent = [], defaultdict(list)
        for output in outputs:
            parent = self.parent_of.get(output.request_id)
            if parent is None:
                gathered.append(output)
            else:
                by_parent[parent].append(output)
        for parent, child_outputs in by_parent.items():
            output = parent.make_output(child_outputs)
            if output is not None:
                gathered.append(output)
            if parent.finished:
                del self.parent_requests[parent.request_id]
                for child in parent.children:
                    del self.parent_of[child.request_id]
                if iteration_stats is not None:
                    iteration_stats.update_from_finished_user_request(
                        len(parent.children), max(child.num_output_tokens for child in parent.children))
        return gathered

    def clear(self) -> None:
        self.states.clear()
        self.detokenized.clear()
        self.parent_requests.clear()
        self.parent_of.clear()
