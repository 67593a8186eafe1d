"""Continuous batching, vLLM V1 style: which requests run this step, and how many tokens each.

There is no prefill phase and decode phase. Each step gives every running request what it still
needs (a decode needs one token, a prompt many), then admits waiting requests, all under
``max_num_batched_tokens`` and ``max_num_seqs``; a long prompt is cut into chunks. A request that
cannot get blocks preempts the most recently admitted one, which is recomputed later.

Scheduling a step advances ``num_computed_tokens`` at once and counts the token the step will
sample as an output placeholder, so the next step can be planned before this one's results are
back (async scheduling); ``update_from_output`` then only appends tokens and checks stops.

A structured-output request samples under its grammar: each plan carries the bitmask rows of those
that sample in it, and ``update_from_output`` advances each grammar with its token. The grammar must
have accepted every earlier token when its row is filled, so the engine does not plan ahead of a
step that samples for one.
"""

from __future__ import annotations

import itertools
from collections import deque
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import numpy as np

from micro_vllm.config import SchedulerConfig
from micro_vllm.core.kv_cache_manager import BlocksPerGroup, KVCacheManager
from micro_vllm.core.request import Request, RequestStatus, append_sampled_tokens
from micro_vllm.core.running_table import RunningTable
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
        # The running requests' counters as arrays, for steps in which all of them decode.
        self.table = RunningTable()
        # The plan's parts for a step in which every running request decodes, kept while the same
        # requests run (``_decode_batch``).
        self.all_decodes: DecodeBatch | None = None
        # Per planned step whose output is not applied yet, oldest first: the table's version then and
        # the table rows it decoded, or None when it was planned request by request.
        self.planned_rows: deque[tuple[int, np.ndarray | None]] = deque()
        # The last plan left a request with known tokens to compute (a prompt in chunks): the next
        # step will not be all decodes, so reading the table for it is wasted.
        self.chunks_left = False
        self.finished_req_ids: set[str] = set()  # since the last plan; the runner drops them
        self.num_listed_tokens: dict[str, int] = {}  # per request, the tokens of it the runner has
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
                self.table.invalidate(reordered=True)
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
        self.num_listed_tokens.clear()
        self.planned_rows.clear()
        self.table.invalidate(reordered=True)
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
        decode_rows = self._schedule_decodes(step)
        if decode_rows is None:
            self._schedule_running(step)
            self.table.invalidate(reordered=False)  # a preemption has reordered it already
        # Admitting requests right after preempting others would only thrash the cache.
        if not step.preempted:
            num_running = len(self.running)
            self._schedule_waiting(step)
            if len(self.running) > num_running:
                self.table.invalidate(reordered=False)
        plan = SchedulerOutput(
            scheduled_new_reqs=tuple(step.new_reqs),
            scheduled_cached_reqs=step.cached_reqs(self._new_token_ids),
            num_scheduled_tokens=step.scheduled_tokens(),
            total_num_scheduled_tokens=step.num_tokens,
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(r.request_id for r in step.preempted),
            structured_output_request_ids={r.request_id: i for i, r in enumerate(step.structured_output_requests)},
            grammar_bitmask=self.get_grammar_bitmask(step.structured_output_requests),
        )
        self.finished_req_ids.clear()
        self.chunks_left = step.chunks_left
        if plan.is_empty:
            self.kv_cache_manager.cancel_step()
        else:
            self.planned_rows.append((self.table.version, decode_rows))
        self.stats = self.make_stats(step)
        return plan

    def get_grammar_bitmask(self, requests: list[Request]) -> torch.Tensor | None:
        """The tokens each of ``requests`` may sample next, one bitmask row each; None for no request.
        A copy: the plan owns it, and the manager's buffer is refilled by the next plan."""
        if not requests:
            return None
        return self.structured_output_manager.grammar_bitmask([r.grammar for r in requests]).clone()

    def make_stats(self, step: _StepBuilder | None = None) -> SchedulerStats:
        """A snapshot of the queues and the KV cache as they are now, with what ``step`` planned
        (nothing when taken between steps)."""
        kv = self.kv_cache_manager
        step = step or _StepBuilder(0)
        decode_req_ids = step.planned_decode_req_ids()
        num_decode_tokens = len(decode_req_ids)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_total_blocks=kv.num_usable_blocks,
            kv_free_blocks=kv.num_free_blocks,
            kv_cached_blocks=kv.num_cached_blocks,
            num_prefill_tokens=step.num_tokens - num_decode_tokens,
            num_decode_tokens=num_decode_tokens,
            decode_req_ids=decode_req_ids,
            prefix_cache_stats=PrefixCacheStats(step.prefix_cache_queries, step.prefix_cache_hits),
            num_preempted_reqs=len(step.preempted),
        )

    def _schedule_running(self, step: _StepBuilder) -> None:
        """Give each running request, oldest first, what it still needs; preempt from the newest
        end when the pool runs dry."""
        kv = self.kv_cache_manager
        running = self.running
        index = 0
        while index < len(running) and step.budget > 0:
            request = running[index]
            index += 1
            num_known = request.num_tokens + request.num_output_placeholders
            if num_known >= request.max_num_tokens:  # a step in flight samples its last allowed token
                continue
            num_computed = request.num_computed_tokens
            num_new = min(num_known - num_computed, step.budget, request.max_chunk_tokens)
            new_blocks = self._allocate_or_preempt(request, num_new, step)
            if new_blocks is None:
                return
            step.cached_req_ids.append(request.request_id)
            step.cached_new_block_ids.append(kv.to_block_ids(new_blocks))
            step.cached_num_computed_tokens.append(num_computed)
            step.add(request, num_new)

    def _schedule_decodes(self, step: _StepBuilder) -> np.ndarray | None:
        """Plan a step in which every running request that computes anything decodes one token, as
        ``_schedule_running`` would, with array operations over all of them. The requests whose
        blocks are full get a new block each in one call; only those that need a block hashed or a
        grammar's bitmask (or all of them, when the pool runs short) go through ``allocate_slots``
        one at a time. Returns the table rows planned; None, having planned nothing, when a request has
        more than one token to compute (or the last plan left one so), the budget is short, or a
        sliding window may free blocks."""
        kv, running = self.kv_cache_manager, self.running
        if not running or not kv.full_attention_only or self.chunks_left:
            return None
        table = self.table
        table.refresh(running, kv)
        num_known = table.num_tokens + table.num_output_placeholders
        # The rest has a step in flight that samples its last allowed token.
        rows = np.flatnonzero(num_known < table.max_num_tokens)
        at_rows = table.index(rows)  # the reads through it may be views of the columns
        num_computed = table.num_computed_tokens[rows]  # a copy: the column advances below
        if len(rows) > step.budget or (num_known[at_rows] - num_computed != 1).any():
            return None
        needs_block = num_computed >= table.num_held_tokens[at_rows]
        needs_own = table.has_grammar[at_rows]
        if kv.enable_caching:  # the step completes a block whose tokens are known: it is hashed
            # The step computes up to num_tokens plus the placeholders: every known token. Not |=:
            # through a slice needs_own is the has_grammar column itself.
            needs_own = needs_own | (table.num_tokens[at_rows] // kv.block_size > table.num_hashed_blocks[at_rows])
        new_block_ids = [None] * len(rows)
        # Most steps only give some requests a block each: in one call while the pool holds them all.
        if needs_own.any() or not self._allocate_decode_blocks(rows, needs_block, new_block_ids):
            rows = self._allocate_decode_slots(rows, needs_own | needs_block, new_block_ids, step)
            num_computed = num_computed[: len(rows)]
            del new_block_ids[len(rows) :]
            at_rows = table.index(rows)
        table.num_computed_tokens[at_rows] += 1
        table.num_output_placeholders[at_rows] += 1  # each samples its next token
        requests = self._running_at(rows)
        for request in requests:
            request.num_computed_tokens += 1
            request.num_output_placeholders += 1
        step.add_decodes(self._decode_batch(rows, requests, num_computed), new_block_ids, num_computed.tolist())
        return rows

    def _decode_batch(self, rows: np.ndarray, requests: list[Request], num_computed: np.ndarray) -> DecodeBatch:
        """The ``requests`` at table ``rows``, planned one token each after ``num_computed`` tokens, as
        a ``DecodeBatch``. When they are all the running requests and all decode, the same one serves
        every step until the running requests change."""
        table = self.table
        # Against the table's rows, not the running list: a preemption shortens the list, not the table.
        all_rows = table.are_all(rows)
        if all_rows and self.all_decodes is not None and self.all_decodes.req_ids is table.req_ids:
            return self.all_decodes  # they all decoded before: none computes its prompt again while they run
        # A one-token step that computes a prompt's last token is no decode.
        is_decode = num_computed >= table.num_prompt_tokens[rows]
        all_decode = bool(is_decode.all())
        req_ids = table.req_ids if all_rows else tuple([r.request_id for r in requests])
        decode_req_ids = req_ids if all_decode else [req_ids[i] for i in np.flatnonzero(is_decode).tolist()]
        batch = DecodeBatch(req_ids, decode_req_ids)
        if all_rows and all_decode:
            self.all_decodes = batch
        return batch

    def _running_at(self, rows: np.ndarray) -> list[Request]:
        """The running requests at table ``rows``, which are in running order: as many rows as there
        are running requests are all of them, and the list itself serves."""
        running = self.running
        return running if len(rows) == len(running) else [running[row] for row in rows.tolist()]

    def _allocate_decode_blocks(self, rows: np.ndarray, needs_block: np.ndarray,
                                new_block_ids: list[BlockIds | None]) -> bool:
        """Give each decode at table ``rows`` whose blocks are full (``needs_block``) a new block, all
        in one call, and put their ids in ``new_block_ids``; False, having allocated nothing, when
        the pool cannot hold them all (the caller then allocates request by request, preempting)."""
        indices = np.flatnonzero(needs_block)
        if not len(indices):
            return True
        kv, running = self.kv_cache_manager, self.running
        block_rows = rows[indices]
        block_ids = kv.allocate_decode_blocks([running[row] for row in block_rows.tolist()])
        if block_ids is None:
            return False
        for i, ids in zip(indices.tolist(), block_ids):
            new_block_ids[i] = ids
        self.table.num_held_tokens[block_rows] += kv.block_size
        return True

    def _allocate_decode_slots(self, rows: np.ndarray, needs_slots: np.ndarray, new_block_ids: list[BlockIds | None],
                               step: _StepBuilder) -> np.ndarray:
        """``allocate_slots`` for one token, one request at a time, for each decode at table ``rows``
        that ``needs_slots``, with its new blocks' ids put in ``new_block_ids``; preempts from the
        newest end while the pool runs short. Returns the rows still planned: those still running."""
        kv, running = self.kv_cache_manager, self.running
        own_rows, own_requests = [], []
        for i in np.flatnonzero(needs_slots).tolist():
            row = int(rows[i])
            if row >= len(running):  # preempted for an earlier request
                break
            request = running[row]
            new_blocks = self._allocate_or_preempt(request, 1, step)
            if new_blocks is None:
                break
            new_block_ids[i] = kv.to_block_ids(new_blocks)
            own_rows.append(row)
            own_requests.append(request)
            if request.grammar is not None:
                step.structured_output_requests.append(request)
        self.table.update_kv_rows(own_rows, own_requests, kv)
        return rows[: int(np.searchsorted(rows, len(running)))]

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _StepBuilder) -> BlocksPerGroup | None:
        """``allocate_slots`` for a running request, preempting from the newest end until the pool
        holds it; None when the request itself was preempted."""
        kv = self.kv_cache_manager
        new_blocks = kv.allocate_slots(request, num_new)
        while new_blocks is None:
            victim = self.running.pop()
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None
            new_blocks = kv.allocate_slots(request, num_new)
        return new_blocks

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
            step.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=tuple(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_computed,
                    eos_token_ids=request.eos_token_ids,
                    bad_words_token_ids=request.bad_words_token_ids,
                )
            )
            self.num_listed_tokens[request.request_id] = request.num_tokens
            step.add(request, num_new)

    def _new_token_ids(self, req_ids: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Per request, the tokens appended since the last plan that listed it (``new_token_ids``)."""
        new_token_ids = []
        for req_id in req_ids:
            request = self.requests[req_id]
            new_token_ids.append(tuple(request.all_token_ids[self.num_listed_tokens[req_id]:]))
            self.num_listed_tokens[req_id] = request.num_tokens
        return tuple(new_token_ids)

    def update_from_output(self, output: ModelRunnerOutput) -> list[Request]:
        """Append the step's sampled tokens and check stops; return the requests that finished.

        With async scheduling a later step may already be planned: a request that stops here was
        planned once more, and that step's token for it is dropped (it is gone from ``requests``)."""
        if not output.req_ids:  # an empty plan has nothing to confirm
            return []
        self.kv_cache_manager.confirm_step()
        version, rows = self.planned_rows.popleft()
        if rows is not None and version == self.table.version and len(rows) == len(output.req_ids):
            finished = self._update_decodes(output, rows)
        else:
            finished = self._update_requests(output)
        if finished:
            # One pass over the running list per step, not one search per finished request.
            finished_ids = {r.request_id for r in finished}
            kept = [r.request_id not in finished_ids for r in self.running]
            self.running = [r for r, keep in zip(self.running, kept) if keep]
            self._drop_table_rows(np.array(kept, bool))
            for request in finished:
                self._free(request)
        return finished

    def _drop_table_rows(self, kept: np.ndarray) -> None:
        """Requests left the running list (``kept``: which stayed): drop their rows from the table
        and from the steps in flight, which find -1 there."""
        table = self.table
        if table.stale:
            table.invalidate(reordered=True)
            return
        new_rows = table.keep(kept)
        self.planned_rows = deque((version, None if rows is None or version != table.version else new_rows[rows])
                                  for version, rows in self.planned_rows)

    def _update_requests(self, output: ModelRunnerOutput) -> list[Request]:
        """Apply a step's tokens one request at a time; return the requests that stop."""
        requests = self.requests
        finished, computed = [], []
        for request_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
            request = requests.get(request_id)
            if request is None or not token_ids:  # finished or aborted meanwhile, or a middle prompt chunk
                continue
            request.num_output_placeholders -= 1
            request.append_output_token(token_ids[0])
            if request.num_computed_tokens == request.num_tokens:  # a later step computed it already
                computed.append(request)
            self._finish_if_stopped(request, token_ids, finished)
        self.kv_cache_manager.cache_computed_blocks(computed)  # the blocks their new tokens complete
        self.table.invalidate(reordered=False)
        return finished

    def _update_decodes(self, output: ModelRunnerOutput, rows: np.ndarray) -> list[Request]:
        """Apply the tokens of a step that ``_schedule_decodes`` planned (at table ``rows``, no request
        having left the running list since): one token each, appended in one pass, the counters
        updated as arrays. A block completed by a token is hashed, and ``_finish_if_stopped`` runs
        only for the requests that may stop (by length, stop token or grammar)."""
        kv, table, running = self.kv_cache_manager, self.table, self.running
        table.refresh(running, kv)
        sampled = output.sampled_token_ids
        if rows.min(initial=0) < 0:  # requests that finished since the step was planned
            sampled = [ids for ids, row in zip(sampled, rows.tolist()) if row >= 0]
            rows = rows[rows >= 0]
        requests = self._running_at(rows)
        append_sampled_tokens(requests, sampled)
        at_rows = table.index(rows)
        table.num_tokens[at_rows] += 1
        table.num_output_placeholders[at_rows] -= 1
        num_tokens = table.num_tokens[at_rows]  # maybe a view: the column is not written again below
        if kv.enable_caching:  # a later step computed the token already: the block it completes is hashed
            num_full = num_tokens // kv.block_size
            completed = np.flatnonzero((table.num_computed_tokens[at_rows] == num_tokens)
                                       & (num_full > table.num_hashed_blocks[at_rows]))
            if len(completed):
                # Straight to the hashing, without cache_computed_blocks' check per request: the table's
                # count is at most the manager's, which is at most num_full (known tokens only).
                completed_full = num_full[completed]
                kv.cache_full_blocks([requests[i] for i in completed.tolist()], completed_full.tolist())
                table.num_hashed_blocks[rows[completed]] = completed_full
        may_stop = (num_tokens >= table.max_num_tokens[at_rows]) | table.has_grammar[at_rows]
        if len(table.stop_token_ids):  # none when every request ignores EOS and has no stop tokens
            may_stop |= table.may_stop_at(np.fromiter(itertools.chain.from_iterable(sampled), np.int64, len(rows)))
        finished = []
        for i in np.flatnonzero(may_stop).tolist():
            self._finish_if_stopped(requests[i], sampled[i], finished)
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
        self.table.invalidate(reordered=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.num_listed_tokens.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)


class DecodeBatch:
    """Requests that compute one token each as a step's first requests, with the parts of the plan
    and of the stats that list them. Plans never mutate these, so the steps that plan the same
    requests share one."""

    __slots__ = ("req_ids", "num_scheduled_tokens", "decode_req_ids")

    def __init__(self, req_ids: tuple[str, ...], decode_req_ids: Iterable[str]) -> None:
        self.req_ids = req_ids
        self.num_scheduled_tokens = MappingProxyType(dict.fromkeys(req_ids, 1))
        self.decode_req_ids = frozenset(decode_req_ids)  # the others compute a prompt's last token


class _StepBuilder:
    """What one ``schedule()`` call has decided so far; frozen into the plan at the end."""

    __slots__ = ("budget", "num_tokens", "decodes", "num_scheduled", "new_reqs", "cached_req_ids",
                 "cached_new_block_ids", "cached_num_computed_tokens", "preempted", "decode_req_ids",
                 "structured_output_requests", "prefix_cache_queries", "prefix_cache_hits", "chunks_left")

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens still free under max_num_batched_tokens
        self.num_tokens = 0  # tokens scheduled
        # The step's first requests when they are planned at once (``add_decodes``); the request ids
        # below are those of the requests planned one at a time (``add``).
        self.decodes: DecodeBatch | None = None
        self.num_scheduled: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        # The requests the runner holds, as the plan's CachedRequestData lists them.
        self.cached_req_ids: list[str] = []
        self.cached_new_block_ids: list[BlockIds | None] = []
        self.cached_num_computed_tokens: list[int] = []
        self.preempted: list[Request] = []
        self.decode_req_ids: list[str] = []
        self.structured_output_requests: list[Request] = []  # those that sample under a grammar
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens, of the requests admitted
        self.chunks_left = False  # a request planned here has known tokens left to compute

    def add_decodes(self, decodes: DecodeBatch, new_block_ids: list[BlockIds | None], num_computed: list[int]) -> None:
        """Schedule one token of each of ``decodes``, which the runner holds, as the step's first
        requests and its only cached ones; the caller has counted them as computed and their
        placeholders."""
        self.decodes = decodes
        self.cached_new_block_ids += new_block_ids
        self.cached_num_computed_tokens += num_computed
        self.budget -= len(decodes.req_ids)
        self.num_tokens += len(decodes.req_ids)

    def add(self, request: Request, num_tokens: int) -> None:
        """Schedule ``num_tokens`` of ``request``: they count as computed from now on, and a step
        that reaches the end of the known tokens samples one more (a placeholder until it returns)."""
        self.num_scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens
        self.num_tokens += num_tokens
        num_computed = request.num_computed_tokens = request.num_computed_tokens + num_tokens
        self.chunks_left |= num_computed < request.num_tokens
        # A decode computes the one token the request sampled last; anything else is prefill.
        if num_tokens == 1 and num_computed > request.num_prompt_tokens:
            self.decode_req_ids.append(request.request_id)
        if num_computed == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            if request.grammar is not None:
                self.structured_output_requests.append(request)

    def cached_reqs(self, new_token_ids: Callable[[tuple[str, ...]], tuple[tuple[int, ...], ...]]
                    ) -> CachedRequestData:
        """The plan's requests that the runner holds: the decodes, or those planned one at a time."""
        req_ids = tuple(self.cached_req_ids) if self.decodes is None else self.decodes.req_ids
        return CachedRequestData(req_ids, tuple(self.cached_new_block_ids), tuple(self.cached_num_computed_tokens),
                                 new_token_ids(req_ids))

    def scheduled_tokens(self) -> Mapping[str, int]:
        """Request id -> tokens to compute, in the step's order."""
        if self.decodes is None:
            return self.num_scheduled
        if not self.num_scheduled:
            return self.decodes.num_scheduled_tokens
        return {**self.decodes.num_scheduled_tokens, **self.num_scheduled}

    def planned_decode_req_ids(self) -> frozenset[str]:
        """The requests that decode this step (the stats' ``decode_req_ids``)."""
        if self.decodes is None:
            return frozenset(self.decode_req_ids)
        if not self.decode_req_ids:
            return self.decodes.decode_req_ids
        return self.decodes.decode_req_ids.union(self.decode_req_ids)
