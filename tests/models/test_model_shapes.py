"""Attention shapes of real checkpoints on every backend: head sizes that are no power of two (12, 20,
80, 96) beside 64, 128 and 256, GQA ratios 1 to 8, tied and untied embeddings, Llama and Qwen3.
Greedy tokens through the whole engine, fp32 on CPU, identical to transformers'. One layer and a
few tokens each, since the triton rows run under Triton's interpreter; tests/test_gpu.py runs the
same grid on CUDA. Also: which backend serves a head size it cannot, at start-up.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from helpers.gpu_helpers import hf_greedy
from helpers.model_shapes import SHAPES, shape_id, shape_overrides
from helpers.tiny_models import load_hf_reference, make_tiny_model

from micro_vllm import LLM, SamplingParams
from micro_vllm.worker.worker import resolve_attention_backend

BACKENDS = ("reference", "sdpa", "triton")
# Two requests, one crossing a block boundary; a 16-token budget chunks the second prompt beside
# the first one's decodes.
PROMPTS = [[random.Random(seed).randrange(256) for _ in range(n)] for seed, n in ((0, 10), (1, 9))]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per shape: the model directory and transformers' greedy tokens for PROMPTS."""
    root, cache = tmp_path_factory.mktemp("shapes"), {}

    def get(shape):
        if shape not in cache:
            path = make_tiny_model(shape[0], root, name=shape_id(shape), **shape_overrides(shape))
            reference = load_hf_reference(path)
            cache[shape] = path, [hf_greedy(reference, prompt, NUM_TOKENS).tokens for prompt in PROMPTS]
        return cache[shape]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_greedy_matches_transformers(models, shape, backend):
    path, expected = models(shape)
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend=backend, max_model_len=32,
              max_num_batched_tokens=16, max_num_seqs=2, block_size=8)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected


def test_explicit_backend_that_cannot_serve_the_head_size_is_refused(tmp_path):
    path = make_tiny_model("llama", tmp_path, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=272)
    with pytest.raises(ValueError, match=r"attention_backend='triton' .*head size 272.*\['reference', 'sdpa'\]"):
        LLM(model=str(path), device="cpu", dtype="float32", attention_backend="triton")


def test_default_backend_falls_back_to_sdpa_with_a_warning(caplog):
    cuda = torch.device("cuda", 0)  # only its type is read
    assert resolve_attention_backend(None, cuda, 256) == "triton"
    with caplog.at_level(logging.WARNING, logger="micro_vllm.worker.worker"):
        assert resolve_attention_backend(None, cuda, 272) == "sdpa"
    assert "cannot serve head size 272; using sdpa" in caplog.text
    assert resolve_attention_backend(None, torch.device("cpu"), 272) == "sdpa"
