"""Builders for CPU-only core tests: requests, a scheduler over a KV cache, fake runners, and the
design notes' invariants as one checker.

``fake_output`` is the simplest runner: it samples a fixed token. ``FakeRunner`` plays the real
ModelRunner's contract instead: it learns requests only from the plan, keeps its own block tables
from the plan's deltas, writes every scheduled token's "K/V" (an id of the token's whole prefix)
into a shadow paged cache, and checks that every key attention would read there holds exactly the
reading request's prefix. A wrong prefix hit, a cached block written again, a block freed while
still visible to a sliding window, or a block table out of step with the plan all fail that check.
It also checks that the token ids the plans carry (a new request's, then ``new_token_ids``) add up
to exactly the tokens the scheduler holds for each request it plans.
"""

from __future__ import annotations

import itertools
from collections import Counter

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.config import SchedulerConfig
from micro_vllm.core.kv_cache_manager import KVCacheManager, make_kv_cache_groups
from micro_vllm.core.prefix_cache import hash_block_tokens
from micro_vllm.core.request import Request, RequestStatus
from micro_vllm.core.scheduler import Scheduler
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.outputs import ModelRunnerOutput
from micro_vllm.sampling.params import SamplingParams

FULL = AttentionSpec(num_kv_heads=2, head_size=8)
_ids = itertools.count()


def sliding(window: int) -> AttentionSpec:
    return AttentionSpec(num_kv_heads=2, head_size=8, sliding_window=window)


def make_request(prompt, max_tokens=4, request_id=None, **params) -> Request:
    prompt = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
    rid = request_id if request_id is not None else f"r{next(_ids)}"
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), frozenset({0}))


def make_kv_manager(
    num_blocks=16, block_size=4, specs=(FULL,), enable_caching=True, block_listener=None
) -> KVCacheManager:
    return KVCacheManager(make_kv_cache_groups(list(specs)), num_blocks, block_size, enable_caching, block_listener)


def make_scheduler(
    num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
    specs=(FULL,), enable_caching=True, enable_chunked_prefill=True,
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
    )
    return Scheduler(config, max_model_len, make_kv_manager(num_blocks, block_size, specs, enable_caching))


def fake_output(plan: SchedulerOutput, scheduler: Scheduler, token=7) -> ModelRunnerOutput:
    """Sample ``token`` for every request the plan counts a placeholder for (right after ``schedule``,
    with no other step in flight: those whose known tokens are all computed after this step)."""
    req_ids = list(plan.num_scheduled_tokens)
    sampled = [[token] if scheduler.requests[rid].num_output_placeholders else [] for rid in req_ids]
    return ModelRunnerOutput(req_ids, sampled)


def run_to_completion(scheduler: Scheduler, max_steps=10_000, check=None) -> list[Request]:
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        plan = scheduler.schedule()
        finished += scheduler.update_from_output(fake_output(plan, scheduler))
        if check is not None:
            check(scheduler, plan)
    raise AssertionError("requests did not finish: the scheduler made no progress")


def token_ids(outputs) -> list[list[int]]:
    """Each request output's generated token ids, in order."""
    return [o.outputs[0].token_ids for o in outputs]


def block_ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_queue_ids(kv: KVCacheManager) -> list[int]:
    return block_ids(kv.block_pool.free_queue)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- the invariants of the design notes --------------------------------------------------------


def check_invariants(scheduler: Scheduler) -> None:
    """Everything that must hold between steps (after ``update_from_output`` or an abort)."""
    check_block_accounting(scheduler.kv_cache_manager)
    check_cached_blocks(scheduler)
    check_request_states(scheduler)


def check_block_accounting(kv: KVCacheManager) -> None:
    """Reference counts match block tables; the free queue holds exactly the unreferenced blocks."""
    pool = kv.block_pool
    holders = Counter(
        b.block_id for m in kv.managers for blocks in m.req_to_blocks.values() for b in blocks if not b.is_null
    )
    free = free_queue_ids(kv)
    assert len(free) == len(set(free)) == pool.get_num_free_blocks(), "a block is in the free queue twice"
    free_set = set(free)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"{block} is held by {holders[block.block_id]} tables"
        assert (block.ref_cnt == 0) == (block.block_id in free_set), f"{block} free-queue membership is wrong"
    # Reusing a block that holds no cached K/V loses nothing, so all of those go before any cached one.
    cached = [pool.blocks[i].block_hash is not None for i in free]
    assert cached == sorted(cached), "a free block with no cached K/V waits behind a cached one"
    null = pool.null_block
    assert null.ref_cnt == 0 and null.block_hash is None and null.block_id not in free_set
    used = sum(b.ref_cnt > 0 for b in pool.blocks[1:])
    assert len(free) + used == pool.num_usable_blocks == kv.num_usable_blocks


def chained_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The hash of every full block, recomputed from the tokens alone."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


def check_cached_blocks(scheduler: Scheduler) -> None:
    """A hashed block is full, computed, and holds the tokens of every request that holds it; with
    caching on every full computed block is hashed, with it off none is."""
    kv = scheduler.kv_cache_manager
    block_size = kv.block_size
    indexed = []
    for key, block in kv.block_pool.prefix_cache.items():
        assert block.block_hash == key, f"{block} is filed under another hash"
        indexed.append(block.block_id)
    # Every copy of cached content is findable: evicting one copy leaves the others to hit.
    hashed = [block.block_id for block in kv.block_pool.blocks if block.block_hash is not None]
    assert sorted(indexed) == hashed == sorted(set(indexed)), "a hashed block is not in the prefix cache once"
    assert len(kv.block_pool.prefix_cache) == len(hashed)
    for group_id, manager in enumerate(kv.managers):
        for request_id, blocks in manager.req_to_blocks.items():
            request = scheduler.requests[request_id]
            expected = chained_hashes(request.all_token_ids, block_size)
            # A block that ends in a token still in flight is hashed once that token is known.
            num_full = min(request.num_computed_tokens, request.num_tokens) // block_size
            for i, block in enumerate(blocks):
                if block.is_null:
                    continue
                if block.block_hash is None:
                    assert not (kv.enable_caching and i < num_full), f"{request_id}'s full block {i} is not cached"
                    continue
                assert kv.enable_caching, "a block was hashed with prefix caching off"
                assert i < num_full, f"{request_id}'s block {i} is hashed before it is full and computed"
                assert block.block_hash == (expected[i], group_id), f"{request_id}'s block {i} holds other tokens"


def check_request_states(scheduler: Scheduler) -> None:
    """No request lost or held twice; waiting ones hold no blocks; running ones hold exactly the
    blocks their computed tokens fill."""
    kv = scheduler.kv_cache_manager
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert sorted(running_ids + waiting_ids) == sorted(scheduler.requests), "a request is lost or held twice"
    assert len(running_ids) <= scheduler.config.max_num_seqs
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        num_tokens = request.num_tokens + request.num_output_placeholders
        assert request.num_computed_tokens <= num_tokens <= scheduler.max_model_len
        for manager in kv.managers:
            num_blocks = len(manager.req_to_blocks.get(request.request_id, ()))
            assert num_blocks == cdiv(request.num_computed_tokens, kv.block_size)
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0 and request.num_output_placeholders <= 1
        assert not any(m.req_to_blocks.get(request.request_id) for m in kv.managers), "a waiting request holds blocks"


def check_all_free(scheduler: Scheduler) -> None:
    """Nothing is left behind once every request finished (also for a scheduler inside an LLM)."""
    kv = scheduler.kv_cache_manager
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not any(m.req_to_blocks or m.num_cached_blocks for m in kv.managers), "per-request state leaked"


# -- a runner that checks what attention would read ----------------------------------------------


class FakeRunner:
    """The ModelRunner's side of the plan contract, with a shadow KV cache instead of a model.

    A slot holds the id of the whole prefix that ends at its position (what real K/V depend on), so
    a read that finds another request's or another position's K/V fails. The sampled token depends
    only on the request's tokens, like greedy decoding: any scheduling must give the same outputs.

    With ``async_scheduling`` the next step is planned before this one's tokens reach the scheduler,
    as the Engine does: the runner knows each sampled token at once (as the GPU does), the scheduler
    one step later.
    """

    def __init__(self, scheduler: Scheduler, vocab_size: int = 5, async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.in_flight: list[ModelRunnerOutput] = []
        self.vocab_size = vocab_size
        kv = scheduler.kv_cache_manager
        self.block_size = kv.block_size
        self.windows = [m.spec.sliding_window for m in kv.managers]
        self.tables: dict[str, list[list[int]]] = {}  # the runner's own block tables, from the plan
        self.tokens: dict[str, list[int]] = {}
        self.sent_tokens: dict[str, list[int]] = {}  # what the plans carried: new requests' tokens, then new_token_ids
        self.prefix_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.slots: dict[tuple[int, int], list[int | None]] = {}  # (group, block id) -> prefix id per slot
        self.hashed: dict[int, tuple] = {}  # block id -> hash when the last step ended
        self.num_preempted = 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._check_plan(plan)
        self._apply(plan)
        req_ids = list(plan.num_scheduled_tokens)
        # Like each layer of a real forward: every K/V of the step is written before any is read.
        for rid in req_ids:
            self._write_request(rid, plan.num_scheduled_tokens[rid])
        for rid in req_ids:
            self._read_request(rid, plan.num_scheduled_tokens[rid])
        sampled = [self._sample(rid, plan.num_scheduled_tokens[rid]) for rid in req_ids]
        self.hashed = {b.block_id: b.block_hash for b in self.scheduler.kv_cache_manager.block_pool.blocks
                       if b.block_hash is not None}
        self.num_preempted += len(plan.preempted_req_ids)
        return ModelRunnerOutput(req_ids, sampled)

    def step(self) -> list[Request]:
        """One engine step with every invariant checked after it."""
        plan = self.scheduler.schedule()
        output = self.execute(plan)
        if not plan.is_empty:
            self.in_flight.append(output)
        finished = []
        depth = 2 if self.async_scheduling else 1
        if self.in_flight and (len(self.in_flight) >= depth or plan.is_empty):
            finished = self.scheduler.update_from_output(self.in_flight.pop(0))
        check_invariants(self.scheduler)
        return finished

    # -- the plan ------------------------------------------------------------------------------

    def _check_plan(self, plan: SchedulerOutput) -> None:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        counts = plan.num_scheduled_tokens
        assert sum(counts.values()) == plan.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert all(n >= 1 for n in counts.values())
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        new_ids = [r.req_id for r in plan.scheduled_new_reqs]
        cached = plan.scheduled_cached_reqs
        cached_ids = list(cached.req_ids)
        assert len(cached.new_block_ids) == len(cached.num_computed_tokens) == len(cached.new_token_ids) == len(cached_ids)
        assert sorted(new_ids + cached_ids) == sorted(counts), "the plan's parts disagree"
        assert not plan.preempted_req_ids & set(counts), "a preempted request is scheduled"
        assert all(scheduler.requests[r].status == RequestStatus.PREEMPTED for r in plan.preempted_req_ids)
        for new in plan.scheduled_new_reqs:
            request = scheduler.requests[new.req_id]
            assert new.block_ids == kv.get_block_ids(new.req_id)
            assert list(new.token_ids) == request.all_token_ids
            assert new.num_computed_tokens + counts[new.req_id] == request.num_computed_tokens
            assert new.num_computed_tokens % self.block_size == 0, "a prefix hit is not whole blocks"
            # The last-token rule: a hit never covers the last token, whose logits are needed.
            assert new.num_computed_tokens < len(new.token_ids)
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            assert num_computed + counts[req_id] == scheduler.requests[req_id].num_computed_tokens
        for req_id in counts:
            request = scheduler.requests[req_id]
            assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders

    def _apply(self, plan: SchedulerOutput) -> None:
        """What the real runner does to its persistent batch."""
        for req_id in plan.finished_req_ids | plan.preempted_req_ids:
            for state in (self.tables, self.tokens, self.sent_tokens, self.prefix_ids, self.num_computed):
                state.pop(req_id, None)
        for new in plan.scheduled_new_reqs:
            assert new.req_id not in self.tables, "a new request the runner already holds"
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.tokens[new.req_id] = list(new.token_ids)
            self.sent_tokens[new.req_id] = list(new.token_ids)
            self.prefix_ids[new.req_id] = []
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = plan.scheduled_cached_reqs
        for req_id, new_token_ids, new_block_ids, num_computed in zip(
                cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
            assert req_id in self.tables, "a delta for a request the runner does not hold"
            assert num_computed == self.num_computed[req_id]
            self.sent_tokens[req_id] += new_token_ids
            if new_block_ids is not None:
                assert all(new_block_ids), "a group without new blocks"
                for table, ids in zip(self.tables[req_id], new_block_ids):
                    table.extend(ids)
        kv = self.scheduler.kv_cache_manager
        for req_id in plan.num_scheduled_tokens:
            # The scheduler lags behind by the tokens still in flight.
            request = self.scheduler.requests[req_id]
            known = request.all_token_ids
            assert self.tokens[req_id][: len(known)] == known
            # The plans have carried every token the scheduler knows, each once.
            assert self.sent_tokens[req_id] == known, f"{req_id}'s new_token_ids disagree with its tokens"
            assert len(self.tokens[req_id]) - len(known) <= request.num_output_placeholders
            for table, manager in zip(self.tables[req_id], kv.managers):
                blocks = manager.req_to_blocks[req_id]
                # The runner keeps the ids a sliding window has let go of; it never reads them.
                assert len(table) == len(blocks)
                assert all(b.is_null or b.block_id == t for b, t in zip(blocks, table))

    # -- one request's share of the step ------------------------------------------------------

    def _prefix_id(self, req_id: str, position: int) -> int:
        ids, tokens = self.prefix_ids[req_id], self.tokens[req_id]
        while len(ids) <= position:
            ids.append(hash((ids[-1] if ids else -1, tokens[len(ids)])))
        return ids[position]

    def _write_request(self, req_id: str, num_new: int) -> None:
        start = self.num_computed[req_id]
        for group, table in enumerate(self.tables[req_id]):
            for pos in range(start, start + num_new):
                self._write(group, table[pos // self.block_size], pos % self.block_size, self._prefix_id(req_id, pos))

    def _read_request(self, req_id: str, num_new: int) -> None:
        """Every key a query of this step can see holds this request's K/V, in a block it holds."""
        start = self.num_computed[req_id]
        managers = self.scheduler.kv_cache_manager.managers
        for group, (table, window) in enumerate(zip(self.tables[req_id], self.windows)):
            held = managers[group].req_to_blocks[req_id]
            first_visible = 0 if window is None else max(0, start - window + 1)
            self._check_sliding_window_freed(held, window, first_visible)
            for pos in range(first_visible, start + num_new):
                index, offset = divmod(pos, self.block_size)
                assert held[index].block_id == table[index], f"{req_id} sees position {pos} in a block it let go"
                assert table[index] != 0, f"{req_id} sees position {pos} in the null block"
                stored = self.slots[(group, table[index])][offset]
                assert stored == self._prefix_id(req_id, pos), f"{req_id} reads wrong K/V at position {pos}"

    def _sample(self, req_id: str, num_new: int) -> list[int]:
        end = self.num_computed[req_id] + num_new
        self.num_computed[req_id] = end
        if end < len(self.tokens[req_id]):
            return []  # a prompt chunk: no logits yet
        token = 1 + self._prefix_id(req_id, end - 1) % self.vocab_size
        self.tokens[req_id].append(token)
        return [token]

    def _write(self, group: int, block_id: int, offset: int, prefix_id: int) -> None:
        assert block_id != 0, "K/V written into the null block"
        slots = self.slots.setdefault((group, block_id), [None] * self.block_size)
        block = self.scheduler.kv_cache_manager.block_pool.blocks[block_id]
        if block.block_hash is not None and self.hashed.get(block_id) == block.block_hash:
            assert slots[offset] == prefix_id, f"cached block {block_id} is written with other K/V"
        slots[offset] = prefix_id

    def _check_sliding_window_freed(self, held: list, window: int | None, first_visible: int) -> None:
        """A sliding window holds no block that lies wholly before what its queries can see."""
        if window is None:
            return
        num_gone = first_visible // self.block_size
        if window == 1 and num_gone > 0 and not held[num_gone - 1].is_null:
            num_gone -= 1  # a cache hit keeps one real block, even when a window of 1 needs none
        assert all(b.is_null for b in held[:num_gone]), "a block slid out but is held"
