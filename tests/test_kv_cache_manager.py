"""Exact block ids after allocation, cache hits, frees and evictions (vLLM tests/v1/core style)."""

import subprocess
import sys

from micro_vllm.attention.spec import AttentionSpec
from core_helpers import make_kv_manager, make_request


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
    # Freed tail first: the request's last block is evicted first, its first block last.
    assert [b.block_id for b in kv.block_pool.free_queue] == [4, 5, 6, 7, 8, 9, 3, 2, 1]


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
    assert [blk.block_id for blk in kv.block_pool.free_queue] == [4, 5, 6, 3, 2, 1]
    # Cached blocks survive in the free queue: a new request with the same prefix reuses them.
    b = make_request(list(range(8)) + [2])
    blocks, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 8 and ids(blocks) == [[1, 2]]
    assert ids(kv.allocate_slots(b, 1, num_computed, blocks)) == [[4]]
    kv.free(b)
    assert [blk.block_id for blk in kv.block_pool.free_queue] == [5, 6, 3, 4, 2, 1]
    # Unrelated requests take free blocks from the front: the cached prefix is used last.
    c = make_request(list(range(100, 116)))
    assert ids(allocate_prompt(kv, c)[2]) == [[5, 6, 3, 4]]
    _, num_computed = kv.get_computed_blocks(make_request(list(range(8)) + [3]))
    assert num_computed == 8
    # One more block evicts the least recently used cached block (2, the prefix's tail).
    e = make_request([200, 201, 202])
    assert ids(allocate_prompt(kv, e)[2]) == [[2]]
    _, num_computed = kv.get_computed_blocks(make_request(list(range(8)) + [3]))
    assert num_computed == 4


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
