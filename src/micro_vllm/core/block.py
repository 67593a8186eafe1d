"""Logical KV blocks, the free-block queue in eviction order, and the pool that hands them out.

Physical K/V live in the ModelRunner's tensors; here a block is an id, a reference count and, once
full, a content hash. Block 0 is the null block: it stands in block tables for positions a sliding
window no longer needs and is never allocated or freed.
"""

from __future__ import annotations

from typing import Literal, Protocol

from micro_vllm.core.prefix_cache import PrefixCache

BlockEventKind = Literal["allocated", "hit", "freed", "cached", "evicted"]


class BlockEventListener(Protocol):
    """Told what happens to blocks (the trace at level "block"). ``request_id`` is None for what no
    one request caused: a prefix-cache reset, the rollback of a failed step."""

    def on_block_event(self, kind: BlockEventKind, block_ids: list[int], request_id: str | None) -> None: ...


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: tuple[bytes, int] | None = None  # (hash, group id) once full and cached
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: a doubly linked list, so a cache hit can take a block out of
    the middle in O(1). Blocks are taken from the front. Freed blocks that hold no cached K/V join at
    the front, since reusing them loses nothing; cached ones join at the back, so the least recently
    used cached block is evicted first."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take the first ``num_blocks`` blocks, unlinked as one run."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks; {self.num_free_blocks} free")
        blocks = []
        block = self._head.next_free
        for _ in range(num_blocks):
            blocks.append(block)
            block = block.next_free
        for taken in blocks:
            taken.prev_free = taken.next_free = None
        self._head.next_free, block.prev_free = block, self._head
        self.num_free_blocks -= num_blocks
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def prepend(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in their order: the first one is taken first."""
        anchor = self._head
        for block in blocks:
            self._insert_after(anchor, block)
            anchor = block

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        after = anchor.next_free
        anchor.next_free, block.prev_free = block, anchor
        block.next_free, after.prev_free = after, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None


class BlockPool:
    """All blocks of the cache, shared by every KV cache group; owns the free queue and the prefix
    cache table, and reports what happens to blocks to an optional listener (the trace)."""

    def __init__(self, num_blocks: int, listener: BlockEventListener | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is too small: one block is reserved, one more is needed")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.prefix_cache = PrefixCache()
        self.listener = listener

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int, request_id: str | None = None) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue: a cached one forgets its hash."""
        blocks = self.free_queue.popleft_n(num_blocks)
        evicted = [b.block_id for b in blocks if b.block_hash is not None and self.prefix_cache.evict(b)]
        for block in blocks:
            block.block_hash = None
            block.ref_cnt = 1
        if self.listener is not None:  # the ids are listed for it alone
            self._notify("evicted", evicted, request_id)
            self._notify("allocated", [b.block_id for b in blocks], request_id)
        return blocks

    def touch(self, blocks: list[KVCacheBlock], request_id: str | None = None) -> None:
        """Take a reference on cached blocks a new request reuses, pulling free ones out of the queue."""
        hit = []
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            hit.append(block.block_id)
        self._notify("hit", hit, request_id)

    def free_blocks(self, ordered_blocks: list[KVCacheBlock], request_id: str | None = None) -> None:
        """Drop a reference on each block, given in eviction order (callers pass a request's tail
        first, so its prefix is evicted last). Blocks that reach zero and hold no cached K/V go to
        the front of the free queue, to be reused first; cached ones to the back, so they live longer."""
        freed, uncached = [], []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block.block_id)
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self.free_queue.append(block)
        self.free_queue.prepend(uncached)
        self._notify("freed", freed, request_id)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, group_id: int, request_id: str) -> None:
        self.prefix_cache.insert(block, block_hash, group_id)
        if self.listener is not None:  # most decode steps hash a block for some requests: no list for nobody
            self._notify("cached", [block.block_id], request_id)

    def uncache(self, block: KVCacheBlock, key: tuple[bytes, int]) -> None:
        """Forget that ``block`` holds the K/V of ``key`` (a failed step may not have computed them);
        nothing happens if the block was reused meanwhile."""
        if block.block_hash == key:
            self.prefix_cache.evict(block)
            self._notify("evicted", [block.block_id], None)

    def free_all(self) -> None:
        """Return every block to a free queue built anew, once no request holds any (after a failed
        step, which may have stopped in the middle of updating the queue or the prefix cache).
        Uncached blocks come first, so cached ones are evicted last."""
        held = [block.block_id for block in self.blocks[1:] if block.ref_cnt]
        for block in self.blocks:
            block.ref_cnt = 0
        self.prefix_cache.drop_stale()
        self.free_queue = FreeKVCacheBlockQueue(sorted(self.blocks[1:], key=lambda b: b.block_hash is not None))
        self._notify("freed", held, None)

    def get_cached_block(self, block_hash: bytes, group_id: int) -> KVCacheBlock | None:
        return self.prefix_cache.get(block_hash, group_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so later requests compute their prompts anew; refused (False)
        while a request holds blocks, whose hashes must stay."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        evicted = [block.block_id for block in self.blocks if block.block_hash is not None]
        for block in self.blocks:
            block.block_hash = None
        self.prefix_cache.clear()
        self._notify("evicted", evicted, None)
        return True

    def _notify(self, kind: BlockEventKind, block_ids: list[int], request_id: str | None) -> None:
        if self.listener is not None and block_ids:
            self.listener.on_block_event(kind, block_ids, request_id)
