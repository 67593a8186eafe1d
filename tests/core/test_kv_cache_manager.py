"""Exact block ids after allocation, cache hits, frees and evictions (vLLM tests/v1/core style)."""

import subprocess
import sys

import pytest

from micro_vllm.attention.spec import AttentionSpec
from helpers.core_helpers import FULL, free_queue_ids, make_kv_manager, make_request, sliding


def ids(blocks_per_group):
    return [[b.block_id for b in g] for g in blocks_per_group]


def allocate_prompt(kv, request):
    blocks, num_computed = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_computed, num_computed, blocks)
    request.num_computed_tokens = request.num_tokens
    return blocks, num_computed, new


def test_core_imports_no_torch():
    code = (
        "import sys, micro_vllm.core.scheduler, micro_vllm.core.kv_cache_manager, micro_vllm.core.block;"
        "assert 'torch' not in sys.modules, 'core imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_and_free_block_ids():
    kv = make_kv_manager(num_blocks=10, block_size=4)
    request = make_request(10)
    _, num_computed, new = allocate_prompt(kv, request)
    assert num_computed == 0
    assert ids(new) == [[1, 2, 3]]  # block 0 is the null block
    assert kv.num_free_blocks == 6
    kv.free(request)
    assert kv.num_free_blocks == 9
    # Block 3 is partial, so uncached: it goes to the front, to be reused first. The cached blocks
    # join the back tail first: the request's last full block is evicted first, its first block last.
    assert [b.block_id for b in kv.block_pool.free_queue] == [3, 4, 5, 6, 7, 8, 9, 2, 1]


class RecordingListener:
    def __init__(self) -> None:
        self.events = []

    def on_block_event(self, kind, block_ids, request_id) -> None:
        self.events.append((kind, block_ids, request_id))


def test_block_events_reach_the_listener_the_pool_is_given():
    listener = RecordingListener()
    kv = make_kv_manager(num_blocks=10, block_size=4, block_listener=listener)
    first, second = make_request(list(range(10)), request_id="a"), make_request(list(range(10)), request_id="b")
    allocate_prompt(kv, first)
    allocate_prompt(kv, second)  # reuses the first's two full blocks
    kv.free(first)
    kv.free(second)
    assert kv.reset_prefix_cache()
    assert listener.events == [
        ("allocated", [1, 2, 3], "a"), ("cached", [1], "a"), ("cached", [2], "a"),
        ("hit", [1, 2], "b"), ("allocated", [4], "b"),
        ("freed", [3], "a"), ("freed", [4, 2, 1], "b"),  # a block is freed by its last holder only
        ("evicted", [1, 2], None),
    ]


def test_prefix_hit_across_requests_and_last_token_rule():
    kv = make_kv_manager(num_blocks=10, block_size=4)
    first = make_request(list(range(12)))
    allocate_prompt(kv, first)
    # Same 12 tokens: three full blocks are cached, but the last token must be computed, so only
    # two blocks (8 tokens) are a hit.
    twin = make_request(list(range(12)))
    blocks, num_computed = kv.get_computed_blocks(twin)
    assert num_computed == 8 and ids(blocks) == [[1, 2]]
    # A longer prompt with the same first 12 tokens hits all three.
    longer = make_request(list(range(12)) + [99, 98])
    blocks, num_computed = kv.get_computed_blocks(longer)
    assert num_computed == 12 and ids(blocks) == [[1, 2, 3]]
    new = kv.allocate_slots(longer, 2, num_computed, blocks)
    assert ids(new) == [[4]]
    assert [b.ref_cnt for b in kv.block_pool.blocks[1:5]] == [2, 2, 2, 1]


def test_hit_after_free_and_lru_eviction():
    kv = make_kv_manager(num_blocks=7, block_size=4)  # 6 usable blocks
    a = make_request(list(range(8)) + [1])
    allocate_prompt(kv, a)  # blocks 1, 2 (full, cached) and 3
    kv.free(a)
    # Block 3 holds no cached K/V: it is reused first; the cached prefix waits at the back.
    assert [blk.block_id for blk in kv.block_pool.free_queue] == [3, 4, 5, 6, 2, 1]
    # Cached blocks survive in the free queue: a new request with the same prefix reuses them.
    b = make_request(list(range(8)) + [2])
    blocks, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 8 and ids(blocks) == [[1, 2]]
    assert ids(kv.allocate_slots(b, 1, num_computed, blocks)) == [[3]]
    kv.free(b)
    assert [blk.block_id for blk in kv.block_pool.free_queue] == [3, 4, 5, 6, 2, 1]
    # Unrelated requests take free blocks from the front: the cached prefix is used last.
    c = make_request(list(range(100, 116)))
    assert ids(allocate_prompt(kv, c)[2]) == [[3, 4, 5, 6]]
    _, num_computed = kv.get_computed_blocks(make_request(list(range(8)) + [3]))
    assert num_computed == 8
    # One more block evicts the least recently used cached block (2, the prefix's tail).
    e = make_request([200, 201, 202])
    assert ids(allocate_prompt(kv, e)[2]) == [[2]]
    _, num_computed = kv.get_computed_blocks(make_request(list(range(8)) + [3]))
    assert num_computed == 4


def test_freed_blocks_without_cached_kv_are_reused_before_cached_ones():
    kv = make_kv_manager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = make_request(list(range(8)) + [1])
    allocate_prompt(kv, a)  # blocks 1, 2 cached; 3 partial
    y = make_request([100, 101, 102])
    allocate_prompt(kv, y)  # block 4, partial
    kv.free(a)
    kv.free(y)  # freed last, but it caches nothing: it goes first
    assert free_queue_ids(kv) == [4, 3, 2, 1]
    # A two-block request takes the two uncached blocks; a's prefix stays whole.
    assert ids(allocate_prompt(kv, make_request(list(range(200, 205))))[2]) == [[4, 3]]
    assert kv.get_computed_blocks(make_request(list(range(8)) + [2]))[1] == 8


def test_without_caching_freed_blocks_come_back_to_the_front_tail_first():
    kv = make_kv_manager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request(list(range(10)))
    assert ids(allocate_prompt(kv, a)[2]) == [[1, 2, 3]]
    kv.free(a)
    assert free_queue_ids(kv) == [3, 2, 1, 4, 5, 6, 7]


def test_reset_prefix_cache_only_when_no_block_is_held():
    kv = make_kv_manager(num_blocks=7, block_size=4)
    a = make_request(list(range(8)) + [1])
    allocate_prompt(kv, a)  # blocks 1 and 2 full and cached
    assert not kv.reset_prefix_cache()  # a still holds them: nothing changes
    assert kv.get_computed_blocks(make_request(list(range(8)) + [2]))[1] == 8
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert len(kv.block_pool.prefix_cache) == 0
    assert all(block.block_hash is None for block in kv.block_pool.blocks)
    assert kv.get_computed_blocks(make_request(list(range(8)) + [2]))[1] == 0
    assert kv.num_free_blocks == kv.num_usable_blocks
    # The same prefix is cached again when computed again.
    allocate_prompt(kv, make_request(list(range(8)) + [3]))
    assert kv.get_computed_blocks(make_request(list(range(8)) + [4]))[1] == 8


def test_cache_hit_revives_block_counts_against_free():
    kv = make_kv_manager(num_blocks=4, block_size=4)  # 3 usable
    a = make_request(list(range(8)) + [5])
    allocate_prompt(kv, a)
    kv.free(a)
    b = make_request(list(range(8)) + [6, 7, 8, 9, 10])  # 2 cached blocks + 2 new = 4 > 3
    blocks, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 8
    assert kv.allocate_slots(b, 5, num_computed, blocks) is None
    assert kv.num_free_blocks == 3  # nothing changed


def test_sliding_window_frees_blocks_outside_every_window():
    window = AttentionSpec(num_kv_heads=2, head_size=8, sliding_window=4)
    kv = make_kv_manager(num_blocks=10, block_size=2, specs=(window,))
    request = make_request(4, max_tokens=100)
    allocate_prompt(kv, request)  # positions 0..3 in blocks 1, 2
    for _ in range(6):  # decode 6 tokens; only the last 4 positions stay visible
        request.append_output_token(1)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    # 10 tokens computed: the next query (position 10) sees positions 7..10, so blocks holding
    # positions 0..5 (the first three) are replaced by the null block.
    assert ids([kv.managers[0].req_to_blocks[request.request_id]])[0][:3] == [0, 0, 0]
    in_use = sum(b.ref_cnt > 0 for b in kv.block_pool.blocks[1:])
    assert in_use == 2
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks


# -- prefix caching ------------------------------------------------------------------------------


def decode(kv, request, token):
    """One decode step: the sampled token joins the request, and its slot is reserved."""
    request.append_output_token(token)
    new = kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    return new


def test_partial_block_is_not_cached_until_decoding_fills_it():
    kv = make_kv_manager(num_blocks=10, block_size=4)
    first = make_request(list(range(10)))
    assert ids(allocate_prompt(kv, first)[2]) == [[1, 2, 3]]  # block 3 holds tokens 8, 9 only
    assert len(kv.block_pool.prefix_cache) == 2
    # Only whole blocks hit, and never the last token: 9 tokens hit 8, 8 tokens hit 4.
    assert kv.get_computed_blocks(make_request(list(range(9))))[1] == 8
    assert kv.get_computed_blocks(make_request(list(range(8))))[1] == 4
    assert kv.get_computed_blocks(make_request(list(range(13))))[1] == 8
    # Decoding tokens 10 and 11 fills block 3, which is cached as soon as its slots are reserved.
    assert ids(decode(kv, first, 10)) == [[]]
    assert ids(decode(kv, first, 11)) == [[]]
    assert len(kv.block_pool.prefix_cache) == 3
    blocks, num_computed = kv.get_computed_blocks(make_request(list(range(13))))
    assert num_computed == 12 and ids(blocks) == [[1, 2, 3]]


def test_full_hit_leaves_the_last_token_to_compute():
    kv = make_kv_manager(num_blocks=10, block_size=4)
    allocate_prompt(kv, make_request(list(range(12)) + [99]))  # blocks 1..3 cached, 4 partial
    # Everything but the last token is cached: exactly one token is computed, in a new block.
    unaligned = make_request(list(range(12)) + [50])
    blocks, num_computed, new = allocate_prompt(kv, unaligned)
    assert num_computed == 12 and ids(blocks) == [[1, 2, 3]] and ids(new) == [[5]]
    # A prompt that ends on a block boundary gives up its whole last block: hits are whole blocks.
    aligned = make_request(list(range(12)))
    blocks, num_computed, new = allocate_prompt(kv, aligned)
    assert num_computed == 8 and ids(blocks) == [[1, 2]] and ids(new) == [[6]]


def test_equal_blocks_under_different_prefixes_do_not_hit():
    kv = make_kv_manager(num_blocks=10, block_size=4)
    a = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    allocate_prompt(kv, a)
    # Block 1 holds the same tokens as a's block 1, but its parent differs: the chain differs.
    b = make_request([9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == ([[]], 0)
    assert b.block_hashes[1] != a.block_hashes[1]
    # A difference in the middle of a block stops the hit there.
    c = make_request([1, 2, 3, 4, 5, 6, 7, 0, 9])
    blocks, num_computed = kv.get_computed_blocks(c)
    assert num_computed == 4 and ids(blocks) == [[1]]


def test_least_recently_used_cached_block_is_evicted_first():
    kv = make_kv_manager(num_blocks=10, block_size=4)  # 9 usable blocks
    a = make_request(list(range(8)) + [100])
    b = make_request(list(range(20, 28)) + [100])
    allocate_prompt(kv, a)  # 1, 2 cached; 3 partial
    allocate_prompt(kv, b)  # 4, 5 cached; 6 partial
    kv.free(a)
    kv.free(b)
    assert free_queue_ids(kv) == [6, 3, 7, 8, 9, 2, 1, 5, 4]  # uncached partial blocks first
    # A hit takes blocks out of the queue; freed again, they are the most recently used.
    c = make_request(list(range(8)) + [5])
    blocks, num_computed, new = allocate_prompt(kv, c)
    assert ids(blocks) == [[1, 2]] and ids(new) == [[6]]
    kv.free(c)
    assert free_queue_ids(kv) == [6, 3, 7, 8, 9, 5, 4, 2, 1]
    # Seven new blocks take the five uncached ones, then evict b's prefix (freed before a's was
    # last used), tail first.
    assert ids(allocate_prompt(kv, make_request(list(range(50, 74)) + [1]))[2]) == [[6, 3, 7, 8, 9, 5, 4]]
    assert kv.get_computed_blocks(make_request(list(range(20, 28)) + [1]))[1] == 0
    assert kv.get_computed_blocks(make_request(list(range(8)) + [1]))[1] == 8


def test_freed_block_keeps_its_hash_until_it_is_reused():
    kv = make_kv_manager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = make_request(list(range(8)) + [9])
    allocate_prompt(kv, a)
    kv.free(a)
    pool = kv.block_pool
    assert [pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]
    assert pool.get_cached_block(a.block_hashes[1], 0) is pool.blocks[2]
    # Reusing block 2 for other tokens drops its old entry: a's second block no longer hits.
    x = make_request(list(range(50, 55)))
    assert ids(allocate_prompt(kv, x)[2]) == [[3, 2]]
    assert pool.blocks[2].block_hash is None
    assert pool.get_cached_block(a.block_hashes[1], 0) is None
    assert len(pool.prefix_cache) == 2  # a's first block and x's first block
    assert kv.get_computed_blocks(make_request(list(range(8)) + [9]))[1] == 4


def test_block_computed_twice_keeps_the_first_copy_cached():
    kv = make_kv_manager(num_blocks=10, block_size=4)
    a, b = make_request(list(range(8))), make_request(list(range(8)))
    allocate_prompt(kv, a)  # blocks 1, 2
    blocks, num_computed, new = allocate_prompt(kv, b)  # the last-token rule recomputes block 2's tokens
    assert ids(blocks) == [[1]] and ids(new) == [[3]]
    pool = kv.block_pool
    assert pool.get_cached_block(a.block_hashes[1], 0) is pool.blocks[2]
    assert pool.blocks[3].block_hash is not None  # marked, so never written again
    # Evicting the duplicate leaves the first copy's entry alone.
    kv.free(b)
    allocate_prompt(kv, make_request(list(range(50, 74)) + [1]))  # 7 blocks: 4..9, then 3
    assert pool.blocks[3].block_hash is None
    assert pool.get_cached_block(a.block_hashes[1], 0) is pool.blocks[2]


def test_second_copy_of_a_block_stays_findable_once_the_first_is_evicted():
    kv = make_kv_manager(num_blocks=10, block_size=4)
    a, b = make_request(list(range(8))), make_request(list(range(8)))
    allocate_prompt(kv, a)  # blocks 1, 2
    allocate_prompt(kv, b)  # hits block 1; the last-token rule recomputes block 2's tokens into 3
    pool = kv.block_pool
    assert pool.blocks[3].block_hash == pool.blocks[2].block_hash
    assert pool.get_cached_block(a.block_hashes[1], 0) is pool.blocks[2]  # the first copy is found first
    assert len(pool.prefix_cache) == 3
    kv.free(a)
    kv.free(b)
    assert free_queue_ids(kv) == [4, 5, 6, 7, 8, 9, 2, 3, 1]
    # Seven new blocks evict the first copy (block 2); the second copy still serves the prefix.
    assert ids(allocate_prompt(kv, make_request(list(range(50, 74)) + [1]))[2]) == [[4, 5, 6, 7, 8, 9, 2]]
    assert pool.get_cached_block(a.block_hashes[1], 0) is pool.blocks[3]
    blocks, num_computed = kv.get_computed_blocks(make_request(list(range(8)) + [9]))
    assert num_computed == 8 and ids(blocks) == [[1, 3]]


# -- sliding windows and cache groups ------------------------------------------------------------


def test_sliding_window_hit_puts_null_blocks_before_the_window():
    kv = make_kv_manager(num_blocks=16, block_size=2, specs=(sliding(4),))
    a = make_request(list(range(12)))
    allocate_prompt(kv, a)  # blocks 1..6, all full and cached
    kv.free(a)
    # 15 tokens hit at most 7 blocks; block 6 (tokens 12, 13) is new, so the hit ends at token 12,
    # whose query sees positions 9..12: only the last two cached blocks are needed.
    b = make_request(list(range(12)) + [50, 51, 52])
    blocks, num_computed, new = allocate_prompt(kv, b)
    assert num_computed == 12 and ids(blocks) == [[0, 0, 0, 0, 5, 6]]
    assert ids(new) == [[7, 8]]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[1:9]] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_sliding_window_hit_from_the_first_block_needs_no_full_window():
    kv = make_kv_manager(num_blocks=16, block_size=2, specs=(sliding(8),))
    allocate_prompt(kv, make_request([1, 2, 3, 4, 5]))  # blocks 1, 2 cached
    blocks, num_computed = kv.get_computed_blocks(make_request([1, 2, 3, 4, 9, 9]))
    assert num_computed == 4 and ids(blocks) == [[1, 2]]


def test_full_and_sliding_groups_share_the_pool_and_agree_on_hits():
    kv = make_kv_manager(num_blocks=20, block_size=2, specs=(FULL, sliding(4)))
    a = make_request(list(range(6)), max_tokens=10)
    assert ids(allocate_prompt(kv, a)[2]) == [[1, 2, 3], [4, 5, 6]]
    for token in (6, 7, 8, 9):
        decode(kv, a, token)
    # Full attention keeps every block; the window let go of blocks 4, 5, 6 (positions 0..5).
    assert ids([kv.managers[0].req_to_blocks[a.request_id], kv.managers[1].req_to_blocks[a.request_id]]) == [
        [1, 2, 3, 7, 9], [0, 0, 0, 8, 10]]
    assert free_queue_ids(kv)[-3:] == [4, 5, 6]
    # Each group finds its own hit, the window's reaching a freed but still cached block.
    b = make_request(list(range(8)) + [55, 66, 77])
    blocks, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 8 and ids(blocks) == [[1, 2, 3, 7], [0, 0, 6, 8]]
    # Once the window's blocks are evicted, the full group's hit alone is no hit: every group must agree.
    x = make_request(list(range(100, 111)))
    assert ids(allocate_prompt(kv, x)[2]) == [[11, 12, 13, 14, 15, 16], [17, 18, 19, 4, 5, 6]]
    assert kv.get_computed_blocks(b) == ([[], []], 0)


def test_num_blocks_needed_is_bounded_by_the_window():
    kv = make_kv_manager(block_size=4, specs=(FULL, sliding(8)))
    # 1000 tokens, chunks of at most 16: full attention keeps 250 blocks, the window needs
    # ceil((7 + 16) / 4) + 1 = 7, since a chunk's blocks need not start on a block boundary.
    assert [g.spec.max_blocks_per_request(1000, 16, kv.block_size) for g in kv.groups] == [250, 7]
    assert kv.max_blocks_needed(1000, 16) == 257
