"""Continuous batching, vLLM V1 style: which requests run this step, and how many tokens each.

There is no prefill phase and decode phase. Each step gives every running request, oldest first,
what it still needs (a decode needs one token, a prompt many), then admits waiting requests in
arrival order, all under ``max_num_batched_tokens`` and ``max_num_seqs``; a long prompt is cut into
chunks. A request that cannot get blocks preempts the most recently admitted one, which is
recomputed later.

Scheduling a step advances ``num_computed_tokens`` at once and counts the token the step will
sample as an output placeholder, so the next step can be planned before this one's results are
back (async scheduling); ``update_from_output`` then only appends tokens, hashes the blocks they
complete and checks stops.

A structured-output request samples under its grammar: each plan carries the bitmask rows of those
that sample in it, and ``update_from_output`` advances each grammar with its token. The grammar must
have accepted every earlier token when its row is filled, so the engine does not plan ahead of a
step that samples for one.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from micro_vllm.config import SchedulerConfig
from micro_vllm.core.kv_cache_manager import KVCacheManager
from micro_vllm.core.request import Request, RequestStatus
from micro_vllm.core.scheduler_output import BlockIds, CachedRequestData, NewRequestData, SchedulerOutput
from micro_vllm.metrics.stats import PrefixCacheStats, SchedulerStats
from micro_vllm.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    import torch

    from micro_vllm.structured_output.manager import StructuredOutputManager


class Scheduler:
    def __init__(self, config: SchedulerConfig, max_model_len: int, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.finished_req_ids: set[str] = set()  # since the last plan; the runner drops them
        self.stats = self.make_stats()  # made with each plan, while that step's blocks are held
        # Set by the engine with the first structured-output request: the default path never loads it.
        self.structured_output_manager: StructuredOutputManager | None = None

    # -- requests in and out -------------------------------------------------------------------

    def check_fits(self, request: Request) -> int:
        """Every check that a request fits this engine: refuse a prompt that leaves no room under
        ``max_model_len``, or a request that could not run even with the whole cache to itself;
        return the most tokens one step may compute for it. A sliding window holds only the window
        plus the step, so with chunked prefill a request longer than the cache runs in steps small
        enough to fit; without it a prompt, or a resumed request, is computed in one step of up to
        the budget."""
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate: "
                f"max_model_len={self.max_model_len} allows prompts of at most {self.max_model_len - 1} tokens"
            )
        limit = self._max_num_tokens(request)
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        max_chunk = kv.max_chunk_that_fits(limit, budget)
        smallest_chunk = 1 if self.config.enable_chunked_prefill else budget
        if max_chunk < smallest_chunk:
            needed = kv.max_blocks_needed(limit, smallest_chunk)
            raise ValueError(
                f"request {request.request_id!r} can never fit: {limit} tokens need {needed} KV blocks but the "
                f"cache holds {kv.num_usable_blocks}; lower max_model_len or max_tokens, or "
                f"give the cache more memory"
            )
        return max_chunk

    def add_request(self, request: Request) -> None:
        request.max_chunk_tokens = self.check_fits(request)
        request.max_num_tokens = self._max_num_tokens(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort); unknown or finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def reset(self) -> list[Request]:
        """Abort every unfinished request after a failed step and return them: every block is free
        again, and the hashes of the steps whose output was never applied are forgotten."""
        aborted = list(self.requests.values())
        for request in aborted:
            request.status = RequestStatus.FINISHED_ABORTED
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self.finished_req_ids.clear()  # the runner forgets every request too
        self.kv_cache_manager.reset()
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing changes) while requests hold KV blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(self.config.max_num_batched_tokens)
        self.kv_cache_manager.start_step()
        self._schedule_running(step)
        # Admitting requests right after preempting others would only thrash the cache.
        if not step.preempted:
            self._schedule_waiting(step)
        plan = SchedulerOutput(
            scheduled_new_reqs=tuple(step.new_reqs),
            scheduled_cached_reqs=step.cached_reqs(),
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=step.num_tokens,
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(r.request_id for r in step.preempted),
            structured_output_request_ids={r.request_id: i for i, r in enumerate(step.structured_output_requests)},
            grammar_bitmask=self.get_grammar_bitmask(step.structured_output_requests),
        )
        self.finished_req_ids.clear()
        if plan.is_empty:
            self.kv_cache_manager.cancel_step()
        self.stats = self.make_stats(step)
        return plan

    def get_grammar_bitmask(self, requests: list[Request]) -> torch.Tensor | None:
        """The tokens each of ``requests`` may sample next, one bitmask row each; None for no request.
        A view of the manager's buffer, which the next plan refills: not a copy, because every
        executor reads or pickles it while it executes the plan, and a plan that samples under a
        grammar is never left in flight while the next is made (``LLMEngine._execute``). A copy
        would add a pass over every row to each such step, which waits for it."""
        if not requests:
            return None
        return self.structured_output_manager.grammar_bitmask([r.grammar for r in requests])

    def make_stats(self, step: _StepBuilder | None = None) -> SchedulerStats:
        """A snapshot of the queues and the KV cache as they are now, with what ``step`` planned
        (nothing when taken between steps)."""
        kv = self.kv_cache_manager
        step = step or _StepBuilder(0)
        num_decode_tokens = len(step.decode_req_ids)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_total_blocks=kv.num_usable_blocks,
            kv_free_blocks=kv.num_free_blocks,
            kv_cached_blocks=kv.num_cached_blocks,
            num_prefill_tokens=step.num_tokens - num_decode_tokens,
            num_decode_tokens=num_decode_tokens,
            decode_req_ids=frozenset(step.decode_req_ids),
            prefix_cache_stats=PrefixCacheStats(step.prefix_cache_queries, step.prefix_cache_hits),
            num_preempted_reqs=len(step.preempted),
        )

    def _schedule_running(self, step: _StepBuilder) -> None:
        """Give each running request, oldest first, what it still needs; preempt from the newest
        end when the pool runs dry."""
        kv, running = self.kv_cache_manager, self.running
        index = 0
        while index < len(running) and step.budget > 0:
            request = running[index]
            index += 1
            num_known = request.num_tokens + request.num_output_placeholders
            if num_known >= request.max_num_tokens:  # a step in flight samples its last allowed token
                continue
            num_new = min(num_known - request.num_computed_tokens, step.budget, request.max_chunk_tokens)
            new_blocks = kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:  # and every request after it: none is left to plan
                    return
                new_blocks = kv.allocate_slots(request, num_new)
            step.add_cached(request, num_new, kv.to_block_ids(new_blocks))

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Admit waiting requests in arrival order while the budgets and the pool allow."""
        kv = self.kv_cache_manager
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:  # preempted while its last step runs: wait for its token
                return
            if self._leader_computes_prompt(request):
                return
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if num_new > step.budget and not self.config.enable_chunked_prefill:
                return
            num_new = min(num_new, step.budget, request.max_chunk_tokens)
            if kv.allocate_slots(request, num_new, num_computed, computed_blocks) is None:
                return
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:  # the first admission's hit; a resumption is no new hit
                request.num_cached_tokens = num_computed
            step.prefix_cache_queries += request.num_tokens
            step.prefix_cache_hits += num_computed
            step.add_new(request, num_new, kv.get_block_ids(request.request_id))

    def update_from_output(self, output: ModelRunnerOutput) -> list[Request]:
        """Append the step's sampled tokens, hash the blocks they complete, and check stops; return
        the requests that finished.

        With async scheduling a later step may already be planned: a request that stops here was
        planned once more, and that step's token for it is dropped (it is gone from ``requests``)."""
        if not output.req_ids:  # an empty plan has nothing to confirm
            return []
        kv, requests = self.kv_cache_manager, self.requests
        kv.confirm_step()
        finished: list[Request] = []
        for request_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
            request = requests.get(request_id)
            if request is None or not token_ids:  # finished or aborted meanwhile, or a middle prompt chunk
                continue
            request.num_output_placeholders -= 1
            request.append_output_token(token_ids[0])
            # A step planned since may compute the new token already: the block it completes is hashed now.
            kv.cache_blocks(request, request.num_computed_tokens)
            self._finish_if_stopped(request, token_ids, finished)
        if finished:
            # One pass over the running list per step, not one search per finished request.
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
            for request in finished:
                self._free(request)
        return finished

    def _finish_if_stopped(self, request: Request, token_ids: list[int], finished: list[Request]) -> None:
        """The request's grammar accepts its new token, and the request stops (appended to
        ``finished``) or goes on."""
        token_id = token_ids[0]
        if request.grammar is not None and not request.grammar.accept_tokens(token_ids):
            raise RuntimeError(f"request {request.request_id!r} sampled token {token_id}, which its grammar forbids")
        status = self._check_stop(request, token_id)
        if status is not None:
            if request.status is RequestStatus.PREEMPTED:  # while its last token was in flight
                self.waiting.remove(request)
            request.status = status
            finished.append(request)

    # -- helpers -------------------------------------------------------------------------------

    def _max_num_tokens(self, request: Request) -> int:
        """Where the request stops at the latest: its prompt plus ``max_tokens``, within ``max_model_len``."""
        return min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_model_len)

    def _leader_computes_prompt(self, request: Request) -> bool:
        """Whether the request computing the same prompt (``Request.prompt_leader``) has not planned
        all of it yet. Admitted now, ``request`` would compute again what is not planned; once it is,
        every full block of the prompt is hashed and ``request`` reuses them (with prefix caching
        off it computes the prompt itself). Only a running leader holds it back, so a request never
        waits for one that waits itself."""
        leader = request.prompt_leader
        return (
            leader is not None
            and leader.status == RequestStatus.RUNNING
            and leader.num_computed_tokens < leader.num_prompt_tokens
        )

    @staticmethod
    def _check_stop(request: Request, last: int) -> RequestStatus | None:
        """How ``request`` ends now that it sampled ``last``; None while it goes on."""
        params = request.sampling_params
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if request.num_tokens >= request.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)


class _StepBuilder:
    """What one ``schedule()`` call has decided so far; frozen into the plan at the end."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens still free under max_num_batched_tokens
        self.num_tokens = 0  # tokens scheduled
        self.num_scheduled_tokens: dict[str, int] = {}  # in the step's order
        self.new_reqs: list[NewRequestData] = []
        # The requests the runner holds, as the plan's CachedRequestData lists them.
        self.cached_req_ids: list[str] = []
        self.cached_new_token_ids: list[tuple[int, ...]] = []
        self.cached_new_block_ids: list[BlockIds | None] = []
        self.cached_num_computed_tokens: list[int] = []
        self.preempted: list[Request] = []
        self.decode_req_ids: list[str] = []
        self.structured_output_requests: list[Request] = []  # those that sample under a grammar
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens, of the requests admitted

    def add_new(self, request: Request, num_tokens: int, block_ids: BlockIds) -> None:
        """Schedule ``num_tokens`` of ``request``, which joins the runner's batch with every token it has."""
        self.new_reqs.append(NewRequestData.from_request(request, block_ids))
        self._add(request, num_tokens)

    def add_cached(self, request: Request, num_tokens: int, new_block_ids: BlockIds | None) -> None:
        """Schedule ``num_tokens`` more of ``request``, which the runner holds, with the tokens it got
        since a plan last listed it and its new blocks."""
        self.cached_req_ids.append(request.request_id)
        self.cached_new_token_ids.append(tuple(request.all_token_ids[request.num_sent_tokens :]))
        self.cached_new_block_ids.append(new_block_ids)
        self.cached_num_computed_tokens.append(request.num_computed_tokens)
        self._add(request, num_tokens)

    def _add(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` of ``request`` count as computed from now on, and a step that reaches the
        end of the known tokens samples one more (a placeholder until it returns)."""
        request.num_sent_tokens = request.num_tokens  # the plan carries every token it has
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.budget -= num_tokens
        self.num_tokens += num_tokens
        num_computed = request.num_computed_tokens = request.num_computed_tokens + num_tokens
        # A decode computes the one token the request sampled last; anything else is prefill.
        if num_tokens == 1 and num_computed > request.num_prompt_tokens:
            self.decode_req_ids.append(request.request_id)
        if num_computed == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            if request.grammar is not None:
                self.structured_output_requests.append(request)

    def cached_reqs(self) -> CachedRequestData:
        return CachedRequestData(tuple(self.cached_req_ids), tuple(self.cached_new_token_ids),
                                 tuple(self.cached_new_block_ids), tuple(self.cached_num_computed_tokens))
