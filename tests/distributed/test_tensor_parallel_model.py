"""Every tiny model family split over two gloo ranks, against the same model on one rank, in fp32:
each rank's parameters are its slices of the checkpoint, cut independently of the layers (heads
and KV heads, the MLP's features, the vocabulary's rows, padded; norms whole), and greedy decoding
over paged attention (two prefill chunks, then decodes) gives the one rank's tokens, and its logits
within fp32 tolerance, on both ranks alike. The families cover biases, tied and untied embeddings,
sliding windows, q/k norm, every rope type and GQA with fewer KV heads than ranks; one runs the fused
Triton ops (under Triton's interpreter). What each rank runs: helpers/sharded_model.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.sharded_model import load_and_decode
from helpers.tiny_models import FAMILIES, make_tiny_model

ATOL = RTOL = 1e-4
TRITON_OPS = frozenset({"qk_norm", "rotary_embedding", "fused_qk_norm_rope"})  # the ops over heads


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: make_tiny_model(family, root) for family in FAMILIES}


CASES = [pytest.param(family, frozenset(), id=family) for family in FAMILIES] + [
    pytest.param("qwen3_sliding", TRITON_OPS, id="qwen3_sliding-triton_ops"),
]


@pytest.mark.parametrize("family, custom_ops", CASES)
def test_two_ranks_hold_their_slices_and_decode_as_one(rank_pool, model_dirs, family, custom_ops):
    path = model_dirs[family]
    one_rank_tokens, one_rank_logits = load_and_decode(path, custom_ops)
    results = rank_pool.run(load_and_decode, path, custom_ops)
    for tokens, logits in results:
        assert tokens == one_rank_tokens
        for got, expected in zip(logits, one_rank_logits, strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # Every rank holds the whole vocabulary's logits (all-gathered), bit for bit: they sample alike.
    (_, rank0_logits), (_, rank1_logits) = results
    assert all(torch.equal(a, b) for a, b in zip(rank0_logits, rank1_logits))
