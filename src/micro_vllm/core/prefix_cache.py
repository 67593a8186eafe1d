"""Prefix caching: content hashes of full blocks, and the table from hash to cached block.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole
prefixes. SHA-256 makes a collision (and so wrong output) practically impossible.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import TYPE_CHECKING, Iterable

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
    """Hash -> block for every full block whose K/V may be reused.

    Keys carry the KV cache group, since each group keeps its own K/V for the same tokens. A block
    stays in the table while it sits in the free queue, and leaves it only when it is reused.
    """

    def __init__(self) -> None:
        self._table: dict[tuple[BlockHash, int], KVCacheBlock] = {}

    def __len__(self) -> int:
        return len(self._table)

    def items(self) -> Iterable[tuple[tuple[BlockHash, int], KVCacheBlock]]:
        """Every (hash, group) key with its cached block, for checks and traces."""
        return self._table.items()

    def get(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self._table.get((block_hash, group_id))

    def insert(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int) -> None:
        # If these tokens are cached already (two requests computed them at once), the first block
        # stays the canonical one; the second is still marked so it is never written again.
        block.block_hash = (block_hash, group_id)
        self._table.setdefault((block_hash, group_id), block)

    def drop_stale(self) -> None:
        """Forget entries whose block no longer carries their hash (an eviction that was stopped
        half-way), so a lookup never returns a block that will be written with other tokens."""
        self._table = {key: block for key, block in self._table.items() if block.block_hash == key}

    def clear(self) -> None:
        self._table.clear()

    def evict(self, block: KVCacheBlock) -> bool:
        """Forget ``block``'s hash before it is reused; True if it was the cached copy."""
        key = block.block_hash
        block.block_hash = None
        if key is not None and self._table.get(key) is block:
            del self._table[key]
            return True
        return False
