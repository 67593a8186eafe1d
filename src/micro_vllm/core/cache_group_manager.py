"""One manager per KV cache group: the block tables of layers that share an attention spec.

Full attention keeps every block of a request. A sliding window frees the blocks that every future
query has slid past, putting the null block in their place, so long generations stay in a bounded
number of blocks. Both find prefix-cache hits in their own way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.core.block import BlockPool, KVCacheBlock
from micro_vllm.core.prefix_cache import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager(ABC):
    def __init__(self, spec: AttentionSpec, block_pool: BlockPool, block_size: int, group_id: int) -> None:
        self.spec = spec
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free blocks needed to hold ``num_tokens``: new blocks, plus reused cached blocks that are
        sitting in the free queue (taking them shrinks it just the same)."""
        num_held = len(self.req_to_blocks[request_id]) + len(new_computed_blocks)
        num_new = max(cdiv(num_tokens, self.block_size) - num_held, 0)
        if not new_computed_blocks:
            return num_new
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        if new_computed_blocks:
            self.req_to_blocks[request_id].extend(new_computed_blocks)
            self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new, request_id)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: list[BlockHash],
                     num_full: int) -> list[tuple[KVCacheBlock, tuple[BlockHash, int]]]:
        """Hash the request's first ``num_full`` blocks, full and never written again, with its
        ``block_hashes`` (which cover them). Returns the blocks hashed now, each with its key."""
        hashed = []
        blocks = self.req_to_blocks[request_id]
        for i in range(self.num_cached_blocks.get(request_id, 0), num_full):
            block = blocks[i]
            if block.block_hash is None and not block.is_null:
                self.block_pool.cache_full_block(block, block_hashes[i], self.group_id, request_id)
                hashed.append((block, block.block_hash))
        self.num_cached_blocks[request_id] = num_full
        return hashed

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        # Tail first: a request's last blocks are the least likely to be shared, so evict them first.
        self.block_pool.free_blocks(blocks[::-1], request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no future query can see. Full attention sees everything."""

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The cached blocks that let a request skip its first ``len(result) * block_size`` tokens."""


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        hit = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hit.append(block)
        return hit


class SlidingWindowManager(SingleTypeKVCacheManager):
    @property
    def window(self) -> int:
        return self.spec.sliding_window

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        # Only the blocks under the last window matter: search from the right for enough contiguous
        # cached blocks; everything before them can be the null block.
        num_blocks = max_length // self.block_size
        needed = max(1, cdiv(self.window - 1, self.block_size))
        hit = [self.block_pool.null_block] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run >= needed:
                return hit[: i + run]
        return hit[:run]  # a shorter run that starts at the first block is a hit too

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        first_visible = num_computed_tokens - self.window + 1  # the next query's first visible key
        blocks = self.req_to_blocks[request_id]
        removed = []
        for i in range(min(first_visible // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was removed earlier
            removed.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(removed, request_id)


def make_manager(spec: AttentionSpec, block_pool: BlockPool, block_size: int, group_id: int) -> SingleTypeKVCacheManager:
    cls = FullAttentionManager if spec.sliding_window is None else SlidingWindowManager
    return cls(spec, block_pool, block_size, group_id)
