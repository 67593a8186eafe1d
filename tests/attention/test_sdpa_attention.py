"""The batched sdpa backend against the reference backend, on random paged batches (fresh each run).

The batches come from helpers/attention.py's builder: shuffled pages, decodes mixed with prefill
chunks, windows whose pages before the window are unmapped, and a cache poisoned with NaN wherever
no request's context lies, so a read outside a context shows up as NaN in the output.
"""

from __future__ import annotations

import random

import pytest
import torch

from micro_vllm.attention.backends import sdpa
from micro_vllm.attention.backends.registry import get_backend_cls
from helpers.attention import make_batch, random_requests

# (num_heads, num_kv_heads, head_size, block_size, sliding_window)
SHAPES = [
    (2, 2, 16, 4, None),  # MHA, several pages per context
    (6, 2, 32, 16, None),  # GQA 3
    (4, 1, 16, 8, 5),  # GQA 4 with a window shorter than a chunk
    (8, 2, 16, 16, 20),  # window spanning a page boundary
]


def sdpa_metadata(batch, window) -> sdpa.SdpaMetadata:
    """The step's metadata as the builder of a KV cache group with ``window`` builds it."""
    return batch.built_by(sdpa.SdpaMetadataBuilder, window)


def check_sdpa_against_reference(batch, window) -> None:
    scale = batch.query.shape[-1] ** -0.5
    expected = get_backend_cls("reference")().forward(batch.query, batch.clean_cache, batch.metadata, scale=scale,
                                                      sliding_window=window)
    out = get_backend_cls("sdpa")().forward(batch.query, batch.kv_cache, sdpa_metadata(batch, window), scale=scale,
                                            sliding_window=window)
    n = batch.metadata.common.num_actual_tokens
    assert not out[:n].isnan().any(), "NaN in the output: sdpa read a slot outside a request's context"
    torch.testing.assert_close(out[:n], expected[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-KV{s[1]}-D{s[2]}-B{s[3]}-w{s[4]}")
@pytest.mark.parametrize("mix", ["decodes", "chunks", "mixed"])
def test_batched_forward_matches_reference(rng: random.Random, shape, mix) -> None:
    num_heads, num_kv_heads, head_size, block_size, window = shape
    num_decodes, num_chunks = {"decodes": (5, 0), "chunks": (0, 3), "mixed": (4, 3)}[mix]
    requests = random_requests(rng, num_decodes, num_chunks, max_context=3 * block_size + 5, max_chunk=23)
    batch = make_batch(rng, requests, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size, dtype=torch.float32, sliding_window=window,
                       num_pad_tokens=rng.randint(0, 2), device="cpu")
    check_sdpa_against_reference(batch, window)


def test_layers_share_the_step_layout_built_once(rng: random.Random) -> None:
    """The gather indices and masks are built once per step by the group's builder, not once per layer."""
    batch = make_batch(rng, [(1, 9), (4, 0), (1, 30)], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                       dtype=torch.float32, device="cpu")
    built = []
    original = sdpa.padded_batch

    def counting(*args, **kwargs):
        built.append(args[3])  # the window
        return original(*args, **kwargs)

    backend = get_backend_cls("sdpa")()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sdpa, "padded_batch", counting)
        metadata = sdpa_metadata(batch, 6)
        for _ in range(3):  # the group's layers
            backend.forward(batch.query, batch.clean_cache, metadata, scale=0.25, sliding_window=6)
    assert built == [6, 6]  # the decodes and the chunk, once


@pytest.mark.parametrize("num_pad_tokens", [0, 2])
def test_step_kv_write_matches_reference(rng: random.Random, num_pad_tokens: int) -> None:
    """The write planned once per step fills the same slots as the reference's per-layer write, and skips
    padding tokens (slot -1)."""
    batch = make_batch(rng, [(1, 9), (4, 0), (3, 12)], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                       dtype=torch.float32, num_pad_tokens=num_pad_tokens, device="cpu")
    key, value = torch.randn(2, batch.query.shape[0], 2, 16)
    expected, written = batch.clean_cache.clone(), batch.clean_cache.clone()
    get_backend_cls("reference")().write_kv(key, value, expected, batch.metadata.common.slot_mapping)
    get_backend_cls("sdpa")().write_and_attend(batch.query, key, value, written, sdpa_metadata(batch, None),
                                               scale=0.25, sliding_window=None)
    assert not torch.equal(written, batch.clean_cache)
    assert torch.equal(written, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_is_written_and_read_as_the_reference_does(rng: random.Random, dtype) -> None:
    """kv_cache_dtype="fp8": the step's K/V stored as e4m3 (a value past the range saturates) in the
    reference's slots, and decodes and prefill chunks over the rounded values as the reference's."""
    batch = make_batch(rng, [(1, 9), (4, 0), (3, 12), (1, 20)], num_heads=4, num_kv_heads=2, head_size=16,
                       block_size=8, dtype=dtype, num_pad_tokens=1, device="cpu", kv_cache_dtype=torch.float8_e4m3fn)
    key, value = torch.randn(2, batch.query.shape[0], 2, 16).to(dtype)
    key[0, 0, 0] = 1000.0
    expected_cache, cache = batch.clean_cache.clone(), batch.clean_cache.clone()
    expected = get_backend_cls("reference")().write_and_attend(batch.query, key, value, expected_cache,
                                                               batch.metadata, scale=0.25, sliding_window=None)
    out = get_backend_cls("sdpa")().write_and_attend(batch.query, key, value, cache, sdpa_metadata(batch, None),
                                                     scale=0.25, sliding_window=None)
    assert cache.dtype == torch.float8_e4m3fn and torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    assert cache.float().abs().max() == 448
    n = batch.metadata.common.num_actual_tokens
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: the chunks' attention runs in bf16
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("requests, window, unmasked", [
    ([(1, 9)], None, True),  # one decode: it sees its whole context
    ([(1, 12), (1, 12)], None, True),  # equal contexts: no padding key slot
    ([(1, 5), (1, 20)], None, False),
    ([(1, 30)], 6, True),  # the window's start is the first key slot
])
def test_decode_steps_skip_the_gather_and_the_mask(rng: random.Random, requests, window, unmasked) -> None:
    """A step of decodes only attends in place (no gather of the queries, no scatter of the output),
    and without a mask where every key slot is visible; the output still equals the reference's."""
    batch = make_batch(rng, requests, num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                       dtype=torch.float32, sliding_window=window, device="cpu")
    metadata = sdpa_metadata(batch, window)
    assert metadata.decodes_only and (metadata.batches[0].mask is None) == unmasked
    check_sdpa_against_reference(batch, window)


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: f"H{s[0]}-KV{s[1]}-D{s[2]}-B{s[3]}-w{s[4]}")
def test_bf16_decodes_compute_as_the_reference(rng: random.Random, shape) -> None:
    """bf16 decodes (the batched-matmul path) give the reference backend's output within one step of
    bf16's spacing, over batches of long contexts with and without a window. The bound holds with or
    without the fp32 upcast on CPU; it catches a wrong head or key layout, not the upcast."""
    num_heads, num_kv_heads, head_size, block_size, window = shape
    scale = head_size ** -0.5
    for _ in range(4):
        requests = random_requests(rng, 16, 0, max_context=8 * block_size, max_chunk=1)
        batch = make_batch(rng, requests, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                           block_size=block_size, dtype=torch.bfloat16, sliding_window=window, device="cpu")
        expected = get_backend_cls("reference")().forward(batch.query, batch.clean_cache, batch.metadata,
                                                          scale=scale, sliding_window=window)
        out = get_backend_cls("sdpa")().forward(batch.query, batch.kv_cache, sdpa_metadata(batch, window),
                                                scale=scale, sliding_window=window)
        n = batch.metadata.common.num_actual_tokens
        assert out.dtype == torch.bfloat16
        spacing = torch.finfo(torch.bfloat16).eps * expected[:n].float().abs().clamp_min(1e-3)
        assert ((out[:n].float() - expected[:n].float()).abs() <= spacing).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_decodes_read_keys_and_values_where_they_lie(rng: random.Random, dtype) -> None:
    """fp32 decodes on CPU score each query head against its key rows where they lie in the cache (one
    sampled_addmm over the cache's keys) and sum its weighted value rows there too (one embedding_bag
    over the cache's values): no gathered copy of either. Other dtypes keep the fp32 batched matmuls,
    as both ops would compute in the cache's dtype."""
    batch = make_batch(rng, [(1, 9), (1, 20), (5, 3)], num_heads=6, num_kv_heads=2, head_size=16, block_size=4,
                       dtype=dtype, device="cpu")
    tables = []  # the matrix each op reads rows of
    embedding_bag, sampled_addmm = torch.nn.functional.embedding_bag, torch.sparse.sampled_addmm

    def recording_bag(indices, weight, *args, **kwargs):
        tables.append(("embedding_bag", weight.data_ptr()))
        return embedding_bag(indices, weight, *args, **kwargs)

    def recording_scores(pattern, mat1, mat2, **kwargs):
        tables.append(("sampled_addmm", mat2.data_ptr()))
        return sampled_addmm(pattern, mat1, mat2, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sdpa.F, "embedding_bag", recording_bag)
        patch.setattr(sdpa.torch.sparse, "sampled_addmm", recording_scores)
        if dtype == torch.float32:
            check_sdpa_against_reference(batch, None)
        else:
            get_backend_cls("sdpa")().forward(batch.query, batch.kv_cache, sdpa_metadata(batch, None), scale=0.25,
                                              sliding_window=None)
    keys, values = batch.kv_cache
    expected = [("sampled_addmm", keys.data_ptr()), ("embedding_bag", values.data_ptr())]
    assert tables == (expected if dtype == torch.float32 else [])
