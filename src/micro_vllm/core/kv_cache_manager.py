"""The logical KV cache: block tables, prefix-cache hits and allocation, across cache groups.

Layers with the same attention spec form a group; one ``SingleTypeKVCacheManager`` per group keeps
that group's block tables, and this class coordinates them over one shared ``BlockPool`` (vLLM's
KVCacheCoordinator and KVCacheManager in one place).

A block's hash is registered when the step that computes it is planned, so later requests, in that
very step or the next, reuse it: the device computes a step's K/V before any later read. Until the
step's output is applied the hash is unconfirmed; if the step fails, ``reset`` forgets it, since the
K/V may never have been written.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.core.block import BlockEventListener, BlockPool, KVCacheBlock
from micro_vllm.core.cache_group_manager import make_manager
from micro_vllm.core.prefix_cache import update_block_hashes
from micro_vllm.core.request import Request
from micro_vllm.core.scheduler_output import BlockIds

BlocksPerGroup = list[list[KVCacheBlock]]


@dataclass(frozen=True)
class KVCacheGroup:
    spec: AttentionSpec
    layer_indices: tuple[int, ...]


def make_kv_cache_groups(layer_specs: list[AttentionSpec]) -> list[KVCacheGroup]:
    """Group layers by spec, in order of first appearance."""
    layers: dict[AttentionSpec, list[int]] = {}
    for index, spec in enumerate(layer_specs):
        layers.setdefault(spec, []).append(index)
    return [KVCacheGroup(spec, tuple(indices)) for spec, indices in layers.items()]


def max_blocks_per_request(groups: list[KVCacheGroup], num_tokens: int, max_chunk_tokens: int, block_size: int) -> int:
    """The most blocks one request of ``num_tokens`` holds at once over all groups, in steps of at
    most ``max_chunk_tokens``: what admission checks and what the cache is sized by."""
    return sum(g.spec.max_blocks_per_request(num_tokens, max_chunk_tokens, block_size) for g in groups)


class KVCacheManager:
    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        block_listener: BlockEventListener | None = None,
    ) -> None:
        self.groups = groups
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, block_listener)
        self.managers = [make_manager(g.spec, self.block_pool, block_size, i) for i, g in enumerate(groups)]
        self._no_hit: BlocksPerGroup = [[] for _ in groups]  # read only
        self._no_new_blocks: BlocksPerGroup = [[] for _ in groups]  # read only
        # Without a sliding window no block is released before the request ends, so a step whose
        # tokens fit the blocks held (most decodes) needs nothing from the groups.
        self._full_attention_only = all(g.spec.sliding_window is None for g in groups)
        # Every group's table covers the same tokens and every group has hashed the same leading
        # blocks, so the first group's answers whether a step needs any block or any hash (most
        # decode steps need neither).
        self._first_blocks = self.managers[0].req_to_blocks
        self._first_num_cached_blocks = self.managers[0].num_cached_blocks
        # Per planned step whose output is not applied yet, oldest first: the blocks it hashed, with
        # their hash.
        self.unconfirmed: deque[list[tuple[KVCacheBlock, tuple[bytes, int]]]] = deque()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix-cache hash, in use or free."""
        return len(self.block_pool.prefix_cache)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def max_blocks_needed(self, num_tokens: int, max_chunk_tokens: int) -> int:
        return max_blocks_per_request(self.groups, num_tokens, max_chunk_tokens, self.block_size)

    def max_chunk_that_fits(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The largest step, at most ``max_chunk_tokens``, with which one request of ``num_tokens``
        fits the whole cache; 0 when not even a one-token step does. Full attention holds every
        block whatever the step, a sliding window only the window plus the step: in small enough
        steps a long request runs on a cache far smaller than its length."""
        usable = self.num_usable_blocks
        if self.max_blocks_needed(num_tokens, max_chunk_tokens) <= usable:
            return max_chunk_tokens
        fits, too_big = 0, max_chunk_tokens  # the need only grows with the step
        while too_big - fits > 1:
            mid = (fits + too_big) // 2
            if self.max_blocks_needed(num_tokens, mid) <= usable:
                fits = mid
            else:
                too_big = mid
        return fits

    def get_computed_blocks(self, request: Request) -> tuple[BlocksPerGroup, int]:
        """The longest cached prefix of ``request`` that every group can reuse, and its length.

        The last token is never a hit: it must be computed to get the logits of the next one. A request
        that asks for prompt logprobs gets no hit, as in vLLM: they need the logits of every prompt token.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.managers], 0
        block_hashes = update_block_hashes(request, self.block_size)
        hit_length = request.num_tokens - 1
        while True:  # each group may shorten the hit; stop once all agree
            hits = [m.find_longest_cache_hit(block_hashes, hit_length) for m in self.managers]
            agreed = min(len(h) for h in hits) * self.block_size
            if agreed == hit_length or all(len(h) * self.block_size == agreed for h in hits):
                break
            hit_length = agreed
        num_blocks = agreed // self.block_size
        return [h[:num_blocks] for h in hits], agreed

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: BlocksPerGroup | None = None,
    ) -> BlocksPerGroup | None:
        """Reserve blocks for ``num_new_tokens`` more tokens (after any prefix hit), or return None
        when the pool cannot hold them; nothing changes then but the sliding windows' cleanup."""
        request_id = request.request_id
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if (new_computed_blocks is None and self._full_attention_only
                and num_tokens <= len(self._first_blocks.get(request_id, ())) * self.block_size):
            # No group needs a block (cache_blocks hashes one only when the step fills it).
            self.cache_blocks(request, num_tokens)
            return self._no_new_blocks
        hit = new_computed_blocks or self._no_hit
        needed = 0
        for manager, blocks in zip(self.managers, hit):
            # Blocks a window has slid past go back to the pool first, so they count as free.
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)
            needed += manager.get_num_blocks_to_allocate(request_id, num_tokens, blocks)
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if new_computed_blocks:
            for manager, blocks in zip(self.managers, new_computed_blocks):
                self.block_pool.touch(blocks, request_id)
                manager.save_new_computed_blocks(request_id, blocks)
        new_blocks = [m.allocate_new_blocks(request_id, num_tokens) for m in self.managers]
        self.cache_blocks(request, num_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the full blocks among the first ``num_computed_tokens`` tokens reusable, in every
        group. Their K/V are computed by the step planned last, which confirms them. A block whose
        last token is still in flight is hashed once that token is known (``update_from_output``)."""
        if not self.enable_caching:
            return
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= self._first_num_cached_blocks.get(request.request_id, 0):
            return  # most steps complete no block
        block_hashes = update_block_hashes(request, self.block_size)
        for manager in self.managers:
            hashed = manager.cache_blocks(request.request_id, block_hashes, num_full)
            if hashed and self.unconfirmed:
                self.unconfirmed[-1] += hashed

    def start_step(self) -> None:
        """A step is being planned: record the hashes it registers until its output is applied."""
        self.unconfirmed.append([])

    def cancel_step(self) -> None:
        """The step just planned schedules nothing (so it hashed nothing): no output confirms it."""
        self.unconfirmed.pop()

    def confirm_step(self) -> None:
        """The oldest planned step's output is applied: the K/V it computed exist."""
        self.unconfirmed.popleft()

    def reset(self) -> None:
        """Forget every request and free every block after a failed step, and forget the hashes of
        the steps not confirmed. Built anew, not undone step by step: the failure may have stopped
        any update half-way."""
        for manager in self.managers:
            manager.req_to_blocks.clear()
            manager.num_cached_blocks.clear()
        for hashed in self.unconfirmed:
            for block, key in hashed:
                self.block_pool.uncache(block, key)
        self.unconfirmed.clear()
        self.block_pool.free_all()

    def to_block_ids(self, blocks_per_group: BlocksPerGroup) -> BlockIds | None:
        """The ids of ``allocate_slots``' new blocks, as the plan carries them; None for none."""
        if blocks_per_group is self._no_new_blocks or not any(blocks_per_group):
            return None
        return tuple(tuple(b.block_id for b in blocks) for blocks in blocks_per_group)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request.request_id)

    def get_block_ids(self, request_id: str) -> BlockIds:
        return tuple(tuple(b.block_id for b in m.req_to_blocks.get(request_id, ())) for m in self.managers)
