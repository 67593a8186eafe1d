"""Prefix caching: content hashes of full blocks, and the table from hash to cached block.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole
prefixes. SHA-256 makes a collision (and so wrong output) practically impossible.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from micro_vllm.core.block import KVCacheBlock
    from micro_vllm.core.request import Request

BlockHash = bytes
_ROOT_HASH = b"micro-vllm"


@functools.cache
def _packer(num_tokens: int) -> struct.Struct:
    # A compiled layout per block size packs token ids about twice as fast as array("q").
    return struct.Struct(f"<{num_tokens}q")


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: list[int]) -> BlockHash:
    data = _packer(len(token_ids)).pack(*token_ids)
    return hashlib.sha256((parent_hash or _ROOT_HASH) + data).digest()


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[start : start + block_size]))
    return hashes


class PrefixCache:
    """Hash -> blocks for every full block whose K/V may be reused.

    Keys carry the KV cache group, since each group keeps its own K/V for the same tokens. A block
    stays in the table while it sits in the free queue, and leaves it only when it is reused.

    Two blocks may hold the same tokens (two requests computed them at once, or the last-token rule
    made a request compute a cached block again). Block tables only grow, so neither is replaced by
    the other; both stay findable, so evicting one copy leaves the other a hit. A lookup returns the
    first copy cached; the rare later copies wait in ``_copies`` and the oldest takes its place.
    """

    def __init__(self) -> None:
        self._table: dict[tuple[BlockHash, int], KVCacheBlock] = {}
        self._copies: dict[tuple[BlockHash, int], list[KVCacheBlock]] = {}
        self._num_blocks = 0

    def __len__(self) -> int:
        """Cached blocks, copies included."""
        return self._num_blocks

    def items(self) -> Iterator[tuple[tuple[BlockHash, int], KVCacheBlock]]:
        """Every (hash, group) key with each of its cached blocks, for checks and traces."""
        for key, block in self._table.items():
            yield key, block
            for copy in self._copies.get(key, ()):
                yield key, copy

    def get(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self._table.get((block_hash, group_id))

    def insert(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int) -> None:
        key = (block_hash, group_id)
        block.block_hash = key
        if self._table.setdefault(key, block) is not block:
            self._copies.setdefault(key, []).append(block)
        self._num_blocks += 1

    def drop_stale(self) -> None:
        """Forget entries whose block no longer carries their hash (an eviction that was stopped
        half-way), so a lookup never returns a block that will be written with other tokens."""
        kept = [block for key, block in self.items() if block.block_hash == key]
        self.clear()
        for block in kept:
            self.insert(block, *block.block_hash)

    def clear(self) -> None:
        self._table.clear()
        self._copies.clear()
        self._num_blocks = 0

    def evict(self, block: KVCacheBlock) -> bool:
        """Forget ``block``'s hash before it is reused; True if the block was in the table."""
        key = block.block_hash
        block.block_hash = None
        copies = self._copies.get(key)
        if self._table.get(key) is block:
            if copies:
                self._table[key] = copies.pop(0)
            else:
                del self._table[key]
        elif copies and block in copies:
            copies.remove(block)
        else:
            return False
        if copies is not None and not copies:
            del self._copies[key]
        self._num_blocks -= 1
        return True
