"""The triton attention backend against the reference backend, on fresh random batches each run.

Each test draws its own seed from os.urandom (printed, so a failure shows it; set
MICRO_VLLM_TEST_SEED to replay one). The cache the triton backend reads is poisoned with NaN wherever
it must not look (the null block 0, slots past a request's length, table entries past its last
block, pages outside a sliding window), so a stray read shows up as NaN in the output; the reference
reads a clean copy. On CPU the kernels run under TRITON_INTERPRET=1 (see tests/conftest.py), so the CPU
shapes stay tiny; the GPU class uses real sizes.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from micro_vllm.attention.backends import triton_attn  # noqa: E402
from micro_vllm.attention.backends.abstract import AttentionMetadata, CommonAttentionMetadata  # noqa: E402
from micro_vllm.attention.backends.reference import write_kv_to_cache  # noqa: E402
from micro_vllm.attention.backends.registry import get_backend_cls  # noqa: E402
from micro_vllm.attention.spec import AttentionSpec  # noqa: E402
from micro_vllm.worker.worker import resolve_attention_backend  # noqa: E402
from helpers.attention import DEVICE, ON_GPU, Batch, make_batch, random_requests  # noqa: E402

# (atol, rtol) against the fp32 reference rounded to the same dtype; plus a bound on
# ||out - ref|| / ||ref||. fp16/bf16 round P before P @ V and the output once: a few ulps at most.
TOLERANCE = {
    torch.float32: (2e-4, 2e-4, 1e-4),
    torch.float16: (5e-3, 5e-3, 2e-3),
    torch.bfloat16: (3e-2, 3e-2, 1e-2),
}


def triton_metadata(batch: Batch, sliding_window: int | None = None) -> triton_attn.TritonAttentionMetadata:
    """The step's metadata as the triton builder of a KV cache group with ``sliding_window`` builds it."""
    return batch.built_by(triton_attn.TritonAttentionMetadataBuilder, sliding_window)


def check_against_reference(batch: Batch, sliding_window: int | None) -> None:
    head_size = batch.query.shape[-1]
    scale = head_size**-0.5
    expected = get_backend_cls("reference")().forward(
        batch.query, batch.clean_cache, batch.metadata, scale=scale, sliding_window=sliding_window
    )
    out = get_backend_cls("triton")().forward(
        batch.query, batch.kv_cache, triton_metadata(batch, sliding_window), scale=scale, sliding_window=sliding_window
    )
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    n = batch.metadata.common.num_actual_tokens
    out, expected = out[:n].float(), expected[:n].float()
    atol, rtol, rel_norm = TOLERANCE[batch.query.dtype]
    assert not out.isnan().any(), "NaN in the output: the kernel read a poisoned (forbidden) slot"
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    assert ((out - expected).norm() / expected.norm()).item() < rel_norm


def backend_reference(
    query: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    return get_backend_cls("reference")().forward(query, cache, md, scale=scale, sliding_window=None)


# --------------------------------------------------------------------------------------------------
# Small shapes: run everywhere (interpreter on CPU).

# (num_heads, num_kv_heads, head_size, block_size, dtype, sliding_window)
SMALL_SHAPES = [
    (2, 2, 64, 16, torch.float32, None),  # MHA
    (4, 2, 64, 16, torch.float16, None),  # GQA 2
    (8, 2, 32, 32, torch.float32, None),  # GQA 4, block 32
    (4, 1, 128, 16, torch.float16, 7),  # MQA-like GQA 4, head 128, small window
    (4, 2, 64, 32, torch.bfloat16, 20),  # window spanning a page boundary
    (6, 2, 16, 16, torch.float32, 5),  # GQA 3: group not a power of two
]


def use_small_tiles(monkeypatch) -> None:
    """16-key tiles in the steps built from now on, so that tiny CPU contexts still span many tiles
    (masked edges, unmasked middle)."""
    pick = triton_attn._pick_tiles
    monkeypatch.setattr(triton_attn, "_pick_tiles", lambda *args: pick(*args)._replace(tile_n=16))


def split_decode_steps(monkeypatch, num_splits: int) -> None:
    """Decode steps built from now on split in ``num_splits``; steps with prefill chunks keep one
    split, as the backend's own rule has them (their programs read the step's keys after the cached
    ones)."""
    monkeypatch.setattr(triton_attn, "_num_splits", lambda device, num_reqs, num_kv_heads, max_query_len:
                        num_splits if max_query_len == 1 else 1)


def shape_id(shape) -> str:
    num_heads, num_kv_heads, head_size, block_size, dtype, window = shape
    return f"H{num_heads}-KV{num_kv_heads}-D{head_size}-B{block_size}-{str(dtype)[6:]}-w{window}"


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=shape_id)
@pytest.mark.parametrize("tiles", ["default", "small", "long"])
def test_mixed_batch_matches_reference(rng: random.Random, monkeypatch, shape, tiles: str) -> None:
    num_heads, num_kv_heads, head_size, block_size, dtype, window = shape
    if tiles == "small":
        use_small_tiles(monkeypatch)
    if tiles == "long":  # the long-prefill tiles, on prompts the interpreter can run
        monkeypatch.setattr(triton_attn, "_LONG_QUERY", 2)
    requests = random_requests(rng, num_decodes=3, num_chunks=2, max_context=2 * block_size + 5, max_chunk=19)
    if tiles == "long":  # a chunk taller than the decode tiles, so that the step takes the long ones
        requests.append((17, rng.randint(0, 2 * block_size + 5)))
    batch = make_batch(
        rng,
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        sliding_window=window,
        num_pad_tokens=rng.randint(0, 3),
    )
    check_against_reference(batch, window)
    check_write_and_attend(batch, window)  # the step's own keys from its rows, not through the pages
    if tiles == "long":  # 16-bit rows of 16-byte multiples come by TMA, the others through pointers
        metadata = triton_metadata(batch, window)
        assert metadata.tiles.block_m >= 128 and metadata.tiles.step_kv_tma == (dtype != torch.float32)


def build_step(query_lens: list[int], *, num_heads: int = 4, head_size: int = 128,
               kv_cache_dtype: torch.dtype = torch.bfloat16) -> triton_attn.TritonAttentionMetadata:
    """The metadata the triton builder of a group of layers with ``num_heads`` query heads over 2 KV
    heads of ``head_size`` builds for a step of prompts of ``query_lens`` tokens (no cache needed)."""
    dtype = torch.bfloat16 if kv_cache_dtype.itemsize == 1 else kv_cache_dtype  # the model's
    builder = triton_attn.TritonAttentionMetadataBuilder(AttentionSpec(2, head_size), num_heads, 16, len(query_lens),
                                                         torch.device("cpu"), kv_cache_dtype, dtype)
    lens = torch.tensor(query_lens, dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
    num_tokens = sum(query_lens)
    return builder.build(CommonAttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(query_lens),
        query_start_loc=starts, seq_lens=lens, block_table=torch.zeros(len(query_lens), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    ))


def test_long_prompts_take_the_long_prefill_tiles() -> None:
    """The builder's tiles for a step with a prompt of _LONG_QUERY tokens, by the group's heads and
    cache: the step's rows by TMA, and twice the keys a step, only where TMA can copy them."""
    long = [triton_attn._LONG_QUERY, 1]
    by_tma = build_step(long)
    assert tuple(by_tma.tiles) == (128, 128, 8, 3, False, True, None) and by_tma.kv_from_step and not by_tma.round_step_rows
    assert by_tma.num_query_blocks == (triton_attn._LONG_QUERY + 1) // 64 + 2  # 64 query tokens of 2 heads
    # Heads of 12 bf16 channels are 24 bytes: no TMA, and the 64 keys a step that fit without it.
    assert tuple(build_step(long, head_size=12).tiles) == (128, 64, 8, 3, False, False, None)
    fp32 = build_step(long, kv_cache_dtype=torch.float32)  # shared memory; ptxas and two stages
    assert tuple(fp32.tiles) == (128, 64, 8, 2, False, False, None) and fp32.kv_from_step
    shorter = build_step([triton_attn._LONG_QUERY - 1, 1])
    assert tuple(shorter.tiles) == (64, 32, 4, 2, False, False, None) and shorter.kv_from_step
    assert build_step(long, num_heads=32).tiles.block_m == 128  # 8 queries of 16 heads
    wide = build_step(long, head_size=256)  # wide heads keep theirs, and read every key through the pages
    assert wide.tiles.block_m == 64 and not wide.tiles.step_kv_tma and not wide.kv_from_step
    # An fp8 cache's step reads its rows as the write launch rounded them: the long tiles as any cache's,
    # shorter ones 64 keys a step (the cached keys widen in registers).
    fp8 = build_step(long, kv_cache_dtype=torch.float8_e4m3fn)
    assert fp8.tiles == by_tma.tiles and fp8.kv_from_step and fp8.round_step_rows
    fp8_short = build_step([300, 1], kv_cache_dtype=torch.float8_e4m3fn)
    assert tuple(fp8_short.tiles) == (64, 64, 4, 2, False, False, None)
    assert fp8_short.kv_from_step and fp8_short.round_step_rows
    decodes = build_step([1, 1, 1])  # one program per request, the new K/V stored by the launch
    assert tuple(decodes.tiles) == (16, 128, 4, 3, True, False, None) and decodes.num_query_blocks == 3
    assert decodes.write_kv_in_launch and not decodes.kv_from_step and decodes.decode_order is not None
    # fp8 decodes store their K/V in the attention launch: no rows to round. Their unsplit programs are
    # capped at 168 registers, three an SM (heads up to 128: wider ones would spill).
    fp8_decodes = build_step([1, 1, 1], kv_cache_dtype=torch.float8_e4m3fn)
    assert not fp8_decodes.round_step_rows and fp8_decodes.tiles == decodes.tiles._replace(max_registers=168)
    assert build_step([1, 1, 1], head_size=256, kv_cache_dtype=torch.float8_e4m3fn).tiles.max_registers is None


def test_split_fp8_decodes_drop_the_register_cap(monkeypatch) -> None:
    """The cap lets more programs share an SM, which pays only where they fill the SMs: a decode step
    that splits launches its programs uncapped."""
    monkeypatch.setattr(triton_attn, "_num_splits", lambda *args: 2)
    split = build_step([1, 1, 1], kv_cache_dtype=torch.float8_e4m3fn)
    assert split.num_splits == 2 and split.tiles.max_registers is None


@pytest.mark.parametrize("window", [None, 6])
def test_decode_only_and_single_request(rng: random.Random, monkeypatch, window: int | None) -> None:
    use_small_tiles(monkeypatch)
    kwargs = dict(
        num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype=torch.float32, sliding_window=window
    )
    decodes = [(1, rng.randint(0, 50)) for _ in range(4)]
    check_against_reference(make_batch(rng, decodes, num_pad_tokens=2, **kwargs), window)
    # One request: Triton specialises an int argument equal to 1, which must still compile.
    check_against_reference(make_batch(rng, [(rng.randint(17, 40), rng.randint(0, 20))], **kwargs), window)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_dummy_requests_of_a_padded_decode_graph(rng: random.Random, monkeypatch, num_splits: int) -> None:
    # A captured decode graph keeps num_reqs fixed: spare entries are requests with no query (with
    # or without context), which must cost nothing and disturb nothing.
    monkeypatch.setattr(triton_attn, "_num_splits", lambda *args: num_splits)
    monkeypatch.setattr(triton_attn, "_MIN_SPLIT_KEYS", 16)
    use_small_tiles(monkeypatch)
    requests = [(1, rng.randint(0, 40)), (0, 0), (1, rng.randint(0, 40)), (0, 0), (0, 7)]
    batch = make_batch(
        rng, requests, num_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32,
        num_pad_tokens=2,
    )
    check_against_reference(batch, None)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_order_changes_only_the_programs_order(rng: random.Random, monkeypatch, num_splits: int) -> None:
    """With ``decode_order`` program i serves request order[i]: the same outputs, bit for bit, as in
    request order (and as the reference), dummies of a padded graph included."""
    monkeypatch.setattr(triton_attn, "_num_splits", lambda *args: num_splits)
    monkeypatch.setattr(triton_attn, "_MIN_SPLIT_KEYS", 16)
    use_small_tiles(monkeypatch)
    requests = [(1, context) for context in sorted(rng.sample(range(60), 5))] + [(0, 0)]  # shortest first
    batch = make_batch(rng, requests, num_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                       dtype=torch.float32, num_pad_tokens=2)
    metadata = triton_metadata(batch)
    order = torch.argsort(-batch.metadata.common.seq_lens.long(), stable=True).to(torch.int32)
    in_order, ordered = (
        get_backend_cls("triton")().forward(batch.query, batch.kv_cache,
                                            dataclasses.replace(metadata, decode_order=decode_order),
                                            scale=16**-0.5, sliding_window=None)
        for decode_order in (None, order)
    )
    check_against_reference(batch, None)
    n = batch.metadata.common.num_actual_tokens
    assert torch.equal(ordered[:n], in_order[:n])


def test_the_builder_orders_decode_steps_longest_context_first(rng: random.Random) -> None:
    """The builder gives a decode step its order, longest context first, in a buffer of its own at a
    fixed address (a captured graph reads it); a step with a longer query gets none."""
    spec = AttentionSpec(num_kv_heads=2, head_size=16)
    builder = triton_attn.TritonAttentionMetadataBuilder(spec, 4, 16, 8, torch.device(DEVICE), torch.float32,
                                                         torch.float32)
    shape = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32)
    decodes = make_batch(rng, [(1, context) for context in (5, 40, 5, 17)], **shape)
    order = builder.build(decodes.metadata.common).decode_order
    assert order.tolist() == [1, 3, 0, 2]  # ties keep request order
    assert order.data_ptr() == builder.decode_order.device.data_ptr()
    mixed = make_batch(rng, [(1, 5), (3, 0)], **shape)
    assert builder.build(mixed.metadata.common).decode_order is None



def order_builder():
    """A function that builds, with one triton metadata builder, a step of requests with these
    context lengths, ``query_len`` tokens each, and returns the decode order it got."""
    builder = triton_attn.TritonAttentionMetadataBuilder(AttentionSpec(num_kv_heads=2, head_size=16), 4, 16, 8,
                                                         torch.device(DEVICE), torch.float32, torch.float32)

    def step(seq_lens: list[int], query_len: int = 1) -> torch.Tensor | None:
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        starts = torch.arange(0, query_len * len(seq_lens) + 1, query_len, dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_actual_tokens=query_len * len(seq_lens), max_query_len=query_len, max_seq_len=max(seq_lens),
            query_start_loc=starts.to(DEVICE), seq_lens=lens.to(DEVICE),
            block_table=torch.zeros(len(seq_lens), 1, dtype=torch.int32, device=DEVICE),
            slot_mapping=torch.zeros(query_len * len(seq_lens), dtype=torch.int64, device=DEVICE),
            query_start_loc_cpu=starts, seq_lens_cpu=lens,
        )
        return builder.build(common).decode_order

    return step


def test_the_builder_sorts_again_unless_every_length_grew_by_one() -> None:
    """Across decode steps whose requests finish, join, are preempted or grow unevenly, and a mixed
    step between them, the builder's order is always the one a fresh sort gives."""
    step = order_builder()

    steps = [
        [5, 9, 5, 7],  # ties keep request order
        [6, 10, 6, 8],  # every length grew by one: the same order
        [7, 11, 7, 9],
        [8, 12, 10, 10],  # the third grew by three and now ties with the last
        [9, 13, 11],  # the last finished
        [10, 14, 12, 30],  # one joined
        [11, 15, 13, 31],
        [4, 16, 14, 32],  # the first was preempted and came back with a shorter context
        [17, 14, 33],  # the first finished and the last moved into its row
        [18, 15, 34, 1, 1],  # padded to a graph's size with rows of length 1 ...
        [19, 16, 35, 1, 1],  # ... which stay 1
        [20, 1, 36, 1, 1],  # a request of length 1 in the second row, tied with the padding ...
        [21, 2, 37, 1, 1],  # ... grows above it
        [1, 3, 38, 1, 1],  # a new one of length 1 in the first row sorts after the second
    ]
    for seq_lens in steps:
        expected = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])  # stable
        assert step(seq_lens).tolist() == expected, seq_lens
    assert step([18, 15, 34], query_len=2) is None  # a mixed step keeps no order ...
    assert step([19, 16, 35]).tolist() == [2, 0, 1]  # ... and the next decode step still gets the right one


def test_the_builder_keeps_the_order_of_padded_decode_steps(monkeypatch) -> None:
    """A decode batch padded to a graph's size keeps its rows of length 1 from step to step: the
    order is sorted once, then kept while the real requests each grow by one."""
    step = order_builder()
    sorts = []
    argsort = np.argsort
    monkeypatch.setattr(triton_attn.np, "argsort", lambda *args, **kwargs: sorts.append(1) or argsort(*args, **kwargs))
    for grown in range(3):
        assert step([7 + grown, 12 + grown, 1, 1]).tolist() == [1, 0, 2, 3]
    assert len(sorts) == 1


def test_long_chunk_spans_many_query_blocks(rng: random.Random) -> None:
    # 70 queries with GQA 2 need several 32-query blocks, exercising the request search.
    requests = [(1, 9), (rng.randint(60, 80), rng.randint(0, 30)), (1, 3), (rng.randint(33, 40), 0)]
    batch = make_batch(
        rng, requests, num_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32
    )
    check_against_reference(batch, None)


def test_step_too_long_for_the_grid_is_refused(rng: random.Random, monkeypatch) -> None:
    # CUDA bounds the grid's second dimension (the query blocks) at 65,535; a step that needs more
    # gets an error naming its size when its metadata is built, before any layer launches. Lowered
    # here, so that a small step hits it.
    batch = make_batch(rng, [(70, 0), (1, 5)], num_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                       dtype=torch.float32)
    monkeypatch.setattr(triton_attn, "_MAX_GRID_Y", 2)
    with pytest.raises(ValueError, match="a step of 71 tokens needs 4 query blocks; at most 2"):
        triton_metadata(batch)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_decode(rng: random.Random, monkeypatch, num_splits: int) -> None:
    # The split path is picked on GPUs for few requests; force it so the interpreter covers it too,
    # including splits that get no tile at all (short contexts).
    monkeypatch.setattr(triton_attn, "_num_splits", lambda *args: num_splits)
    monkeypatch.setattr(triton_attn, "_MIN_SPLIT_KEYS", 32)  # 2 tiles of 16 keys
    use_small_tiles(monkeypatch)
    for window in (None, 9):
        decodes = [(1, rng.randint(0, 150)) for _ in range(3)] + [(1, 2)]
        batch = make_batch(
            rng, decodes, num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
            dtype=torch.float16, sliding_window=window, num_pad_tokens=1,
        )
        check_against_reference(batch, window)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_steps_write_their_kv_inside_the_attention_launch(
    rng: random.Random, monkeypatch, num_splits: int
) -> None:
    """``write_and_attend`` on a decode step: the attention kernel stores each request's new K/V
    (no write launch), with splits and windows, dummies of a padded graph and padding tokens; the
    cache ends as the reference's write leaves it and the outputs match. Steps with longer queries
    launch the write first and match too."""
    split_decode_steps(monkeypatch, num_splits)
    monkeypatch.setattr(triton_attn, "_MIN_SPLIT_KEYS", 16)
    use_small_tiles(monkeypatch)
    for window, requests in ((None, [(1, rng.randint(0, 60)) for _ in range(3)] + [(0, 0), (1, 0)]),
                             (9, [(1, rng.randint(0, 60)) for _ in range(3)]),
                             (None, [(1, rng.randint(0, 60)), (rng.randint(2, 20), rng.randint(0, 20))])):
        batch = make_batch(rng, requests, num_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                           dtype=torch.float32, sliding_window=window, num_pad_tokens=2)
        check_write_and_attend(batch, window)


@pytest.mark.parametrize("head_size, num_heads", [(12, 4), (20, 4), (80, 8), (96, 6)])
def test_head_size_not_a_power_of_two(rng: random.Random, monkeypatch, head_size: int, num_heads: int) -> None:
    """Heads padded to 16 lanes (12, 20) or 128 (80, 96) inside the kernels, over 2 KV heads: a
    mixed step with a window (the write kernel, then prefill and decode rows), and a decode step
    that stores its K/V in the attention launch, split in two (the merge kernel)."""
    split_decode_steps(monkeypatch, 2)
    monkeypatch.setattr(triton_attn, "_MIN_SPLIT_KEYS", 16)
    use_small_tiles(monkeypatch)
    shape = dict(num_heads=num_heads, num_kv_heads=2, head_size=head_size, block_size=16, dtype=torch.float32)
    mixed = make_batch(rng, random_requests(rng, 2, 2, max_context=35, max_chunk=19), sliding_window=7,
                       num_pad_tokens=1, **shape)
    check_write_and_attend(mixed, 7)
    decodes = make_batch(rng, [(1, rng.randint(0, 50)) for _ in range(3)], num_pad_tokens=1, **shape)
    check_write_and_attend(decodes, None)


@pytest.mark.parametrize("tiles", ["small", "default", "long"])  # default: the fp8 cache's own prefill tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_cache_matches_reference(rng: random.Random, monkeypatch, dtype: torch.dtype, tiles: str) -> None:
    """A cache of float8 e4m3 (kv_cache_dtype="fp8") under fp32 and bf16 queries: a mixed step with
    a window, then a decode step, each storing fresh K/V (the write kernel, which also rounds the
    step's rows the prefill tiles read back, then the attention launch's own store) as the reference
    stores them, and attending over the rounded values as the reference does; "long" takes the
    long-prefill tiles, the rows of a bf16 model through TMA."""
    if tiles == "small":
        use_small_tiles(monkeypatch)
    if tiles == "long":
        monkeypatch.setattr(triton_attn, "_LONG_QUERY", 2)
    shape = dict(num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype=dtype,
                 kv_cache_dtype=torch.float8_e4m3fn)
    requests = random_requests(rng, 2, 2, max_context=40, max_chunk=12)
    if tiles == "long":  # a chunk taller than the decode tiles, so that the step takes the long ones
        requests.append((17, rng.randint(0, 40)))
    mixed = make_batch(rng, requests, sliding_window=6, num_pad_tokens=1, **shape)
    check_against_reference(mixed, 6)
    check_write_and_attend(mixed, 6)
    if tiles == "long":
        metadata = triton_metadata(mixed, 6)
        assert metadata.tiles.block_m >= 128 and metadata.kv_from_step
        assert metadata.tiles.step_kv_tma == (dtype != torch.float32)
    decodes = make_batch(rng, [(1, rng.randint(0, 50)) for _ in range(3)], num_pad_tokens=1, **shape)
    check_write_and_attend(decodes, None)


def test_head_size_above_256_is_refused(rng: random.Random) -> None:
    """By the backend, and by its builder when the KV cache is allocated: before any step."""
    backend = get_backend_cls("triton")()
    assert backend.supports_head_size(256) and not backend.supports_head_size(272)
    batch = make_batch(rng, [(3, 0)], num_heads=2, num_kv_heads=1, head_size=272, block_size=16,
                       dtype=torch.float32)
    with pytest.raises(ValueError, match="head_size=272 .*at most 256"):
        triton_metadata(batch)


@pytest.mark.parametrize("name", ["reference", "sdpa", "triton"])
def test_query_heads_not_a_multiple_of_kv_heads_are_refused(name: str) -> None:
    builder_cls = get_backend_cls(name).builder_cls
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        builder_cls(AttentionSpec(4, 16), 6, 16, 8, torch.device("cpu"), torch.float32, torch.float32)


class NoWriteLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a decode step launched the K/V write kernel")


def check_write_and_attend(batch: Batch, window: int | None) -> None:
    """The triton backend's ``write_and_attend`` of fresh K/V rows against the reference's: the
    cache ends as the reference's write leaves it (the poison included) and the outputs match; a
    decode step launches no write kernel (fp32 batches)."""
    _, _, _, num_kv_heads, head_size = batch.kv_cache.shape
    num_tokens = batch.query.shape[0]
    new_kv = torch.randn(2, num_tokens, num_kv_heads, head_size, device=DEVICE).to(batch.query.dtype)  # as a layer's
    if batch.kv_cache.dtype.itemsize == 1:  # values past fp8's range, which it must saturate, not make NaN
        new_kv[:, :, 0, 0] = 1000.0
    expected_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    write_kv_to_cache(new_kv[0], new_kv[1], expected_cache, batch.metadata.common.slot_mapping)
    expected = get_backend_cls("reference")().write_and_attend(
        batch.query, *new_kv, batch.clean_cache.clone(), batch.metadata, scale=0.25, sliding_window=window
    )
    metadata = triton_metadata(batch, window)
    with pytest.MonkeyPatch.context() as patch:
        if batch.metadata.common.max_query_len == 1:
            patch.setattr(triton_attn, "_write_kv_kernel", NoWriteLaunch())
        out = get_backend_cls("triton")().write_and_attend(
            batch.query, *new_kv, cache, metadata, scale=0.25, sliding_window=window
        )
    torch.testing.assert_close(cache.float(), expected_cache.float(), atol=0, rtol=0, equal_nan=True)
    n = batch.metadata.common.num_actual_tokens
    atol, rtol, _ = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(rng: random.Random, dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_size = 6, 16, 3, 32
    num_tokens = 11
    # K and V as strided views of one fused projection, as a QKV linear layer produces them.
    fused = torch.randn(num_tokens + 2, 2 * num_kv_heads * head_size + 8).to(dtype).to(DEVICE)
    key = fused[:, : num_kv_heads * head_size].view(-1, num_kv_heads, head_size)
    value = fused[:, num_kv_heads * head_size : -8].view(-1, num_kv_heads, head_size)
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    for i in rng.sample(range(num_tokens), 3):
        slots[i] = -1  # padding
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype).to(DEVICE)
    expected = cache.clone()
    write_kv_to_cache(key, value, expected, slot_mapping)
    # Rows past slot_mapping (key has two more) must not be written anywhere.
    get_backend_cls("triton")().write_kv(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_triton_backend_on_cpu_without_the_interpreter_is_refused_at_start_up(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' .*TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", torch.device("cpu"), 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", torch.device("cpu"), 64) == "triton"


# --------------------------------------------------------------------------------------------------
# Real sizes on a GPU.


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
class TestOnGpu:
    # Every head layout in bf16; fp16 (the same kernels, another element type) on the benchmark's and
    # on a padded head.
    @pytest.mark.parametrize(
        "heads, dtype",
        [(heads, torch.bfloat16) for heads in [(16, 8, 128), (32, 8, 64), (8, 8, 128), (16, 4, 80), (8, 4, 256)]]
        + [((16, 8, 128), torch.float16), ((16, 4, 80), torch.float16)],
        ids=str,
    )
    def test_large_decode_batch(self, rng: random.Random, dtype: torch.dtype, heads) -> None:
        # The benchmark's steady state: 256 decodes, contexts up to 2048, block 16.
        num_heads, num_kv_heads, head_size = heads
        requests = [(1, rng.randint(0, 2047)) for _ in range(256)]
        batch = make_batch(
            rng, requests, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            block_size=16, dtype=dtype, num_pad_tokens=8,
        )
        check_against_reference(batch, None)

    # Each pair of values of the three settings in one case at least (the eight combinations add none).
    @pytest.mark.parametrize(
        "dtype, window, block_size",
        [(torch.bfloat16, None, 16), (torch.bfloat16, 256, 32), (torch.float16, None, 32), (torch.float16, 256, 16)],
        ids=str,
    )
    def test_large_mixed_batch(self, rng: random.Random, dtype: torch.dtype, window, block_size: int) -> None:
        requests = random_requests(rng, num_decodes=64, num_chunks=6, max_context=2048, max_chunk=700)
        batch = make_batch(
            rng, requests, num_heads=16, num_kv_heads=8, head_size=128, block_size=block_size,
            dtype=dtype, sliding_window=window, num_pad_tokens=5,
        )
        check_against_reference(batch, window)

    def test_fp8_cache_at_real_sizes(self, rng: random.Random) -> None:
        """kv_cache_dtype="fp8" under bf16 queries, Qwen3-0.6B's heads: a large mixed step with a
        window, and decodes that split their long contexts."""
        shape = dict(num_heads=16, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                     kv_cache_dtype=torch.float8_e4m3fn)
        mixed = make_batch(rng, random_requests(rng, 48, 6, max_context=700, max_chunk=300), sliding_window=256,
                           num_pad_tokens=3, **shape)
        check_against_reference(mixed, 256)
        check_write_and_attend(mixed, 256)
        decodes = make_batch(rng, [(1, rng.randint(1000, 3000)) for _ in range(4)], **shape)
        check_write_and_attend(decodes, None)
        # Enough decodes to fill the SMs without splits: the programs under their register cap.
        num_reqs = 2 * triton_attn._num_sms(torch.device(DEVICE)) // 8 + 1  # 8 KV heads
        unsplit = make_batch(rng, [(1, rng.randint(100, 900)) for _ in range(num_reqs)], **shape)
        metadata = triton_metadata(unsplit)
        assert metadata.num_splits == 1 and metadata.tiles.max_registers == 168
        check_write_and_attend(unsplit, None)

    @pytest.mark.parametrize("num_reqs", [1, 4, 8])
    def test_few_long_decodes_split_kv(self, rng: random.Random, num_reqs: int) -> None:
        requests = [(1, rng.randint(1000, 4000)) for _ in range(num_reqs)]
        batch = make_batch(
            rng, requests, num_heads=16, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16
        )
        assert triton_metadata(batch).num_splits > 1
        check_against_reference(batch, None)

    @pytest.mark.parametrize("num_reqs", [8, 128], ids=["split-kv", "plain"])
    def test_decode_cuda_graph_replays_any_context(self, rng: random.Random, num_reqs: int) -> None:
        # A graph captured once must serve later steps whose contexts changed: the grid may depend
        # only on num_reqs and the padded token count, never on seq_lens or max_seq_len.
        kwargs = dict(num_heads=16, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)
        batch = make_batch(rng, [(1, 1800)] * num_reqs, num_pad_tokens=4, **kwargs)
        backend, md, scale = get_backend_cls("triton")(), triton_metadata(batch), 128**-0.5
        query = batch.query
        backend.forward(query, batch.kv_cache, md, scale=scale, sliding_window=None)  # compile outside
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = backend.forward(query, batch.kv_cache, md, scale=scale, sliding_window=None)
        for _ in range(3):
            new_lens = torch.tensor([rng.randint(1, 1801) for _ in range(num_reqs)], dtype=torch.int32)
            md.common.seq_lens.copy_(new_lens)
            md.common.seq_lens_cpu.copy_(new_lens)
            query.copy_(torch.randn_like(query))
            graph.replay()
            eager = backend.forward(query, batch.kv_cache, md, scale=scale, sliding_window=None)
            expected = backend_reference(query, batch.clean_cache, md, scale)
            n = md.common.num_actual_tokens
            assert torch.equal(graph_out[:n], eager[:n])
            torch.testing.assert_close(graph_out[:n].float(), expected[:n].float(), atol=3e-2, rtol=3e-2)

    @pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
    @pytest.mark.parametrize("window", [None, 1000])
    def test_long_prompts_read_their_rows_by_tma(self, rng: random.Random, window, kv_cache_dtype) -> None:
        """The long-prefill tiles at the benchmark's heads: a prompt past _LONG_QUERY, one after
        cached context and decodes beside them. The step's own K/V come through tensor descriptors
        (an fp8 cache's as its write launch rounded them), eagerly and replayed from a CUDA graph
        (whose capture allocates the descriptors' memory)."""
        long = triton_attn._LONG_QUERY
        requests = [(long + rng.randint(1, 300), 0), (rng.randint(500, 1500), rng.randint(100, 2000))]
        requests += [(1, rng.randint(1, 3000)) for _ in range(8)]
        batch = make_batch(rng, requests, num_heads=16, num_kv_heads=8, head_size=128, block_size=16,
                           dtype=torch.bfloat16, sliding_window=window, num_pad_tokens=3,
                           kv_cache_dtype=kv_cache_dtype)
        metadata = triton_metadata(batch, window)
        assert metadata.tiles.step_kv_tma
        check_write_and_attend(batch, window)

        backend, n = get_backend_cls("triton")(), batch.metadata.common.num_actual_tokens
        key, value = torch.randn(2, batch.query.shape[0], 8, 128, device="cuda", dtype=torch.bfloat16)
        cache = batch.kv_cache.clone()

        def attend() -> torch.Tensor:  # fresh rows each call, as each step's projections make them
            return backend.write_and_attend(batch.query, key.clone(), value.clone(), cache, metadata,
                                            scale=128**-0.5, sliding_window=window)

        eager = attend()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = attend()
        captured.zero_()
        graph.replay()
        assert torch.equal(captured[:n], eager[:n])

    def test_write_kv_large(self, rng: random.Random) -> None:
        num_tokens, num_blocks, block_size = 4096, 1024, 16
        key = torch.randn(num_tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
        slots[torch.rand(num_tokens, device="cuda") < 0.1] = -1
        cache = torch.randn(2, num_blocks, block_size, 8, 128, device="cuda", dtype=torch.bfloat16)
        expected = cache.clone()
        write_kv_to_cache(key, value, expected, slots)
        get_backend_cls("triton")().write_kv(key, value, cache, slots)
        assert torch.equal(cache, expected)
