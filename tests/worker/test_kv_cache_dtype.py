"""``kv_cache_dtype="fp8"``: the cache holds K/V as float8 e4m3, one byte a value, and every backend
reads it as the reference does."""

from __future__ import annotations

import pytest
import torch

from helpers.core_helpers import token_ids
from helpers.tiny_models import make_tiny_model
from micro_vllm import LLM, SamplingParams

PROMPTS = [[5, 9, 2, 7, 11, 3, 8], [4, 4, 17, 1], list(range(20, 45))]


def runner_of(llm: LLM):
    return llm.engine.executor.worker.model_runner


def test_an_fp8_cache_holds_the_models_kv_rounded_to_e4m3(tmp_path):
    """After the same prompts, the first layer's fp8 cache holds exactly the fp32 engine's K/V
    rounded to e4m3 (later layers see attention over the rounded values), in a quarter of the bytes
    per block of an fp32 model."""
    path = make_tiny_model("qwen3", tmp_path)
    caches, bytes_per_block = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(model=str(path), device="cpu", attention_backend="reference", max_model_len=64, num_blocks=16,
                 kv_cache_dtype=kv_cache_dtype) as llm:
            runner = runner_of(llm)
            first = runner.model.attention_layers()[0]
            first.kv_cache.zero_()  # every block compares, not only those the prompts fill
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=1), use_tqdm=False)
            caches[kv_cache_dtype] = first.kv_cache.clone()
            bytes_per_block[kv_cache_dtype] = runner.kv_cache_bytes_per_block()
    assert caches["auto"].dtype == torch.float32 and caches["fp8"].dtype == torch.float8_e4m3fn
    assert caches["auto"].abs().sum() > 0
    assert torch.equal(caches["fp8"].float(), caches["auto"].to(torch.float8_e4m3fn).float())
    assert bytes_per_block["auto"] == 4 * bytes_per_block["fp8"]


def test_backends_agree_token_for_token_on_an_fp8_cache(tmp_path):
    """sdpa and triton (interpreted on CPU) against the reference, all on an fp8 cache: prefill
    chunks (a budget of 16 tokens) and decodes, greedy."""
    pytest.importorskip("triton")
    path = make_tiny_model("llama", tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "sdpa", "triton"):
        with LLM(model=str(path), device="cpu", attention_backend=backend, kv_cache_dtype="fp8", max_model_len=64,
                 max_num_batched_tokens=16, enable_chunked_prefill=True) as llm:
            tokens[backend] = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                     use_tqdm=False))
    assert tokens["sdpa"] == tokens["reference"]
    assert tokens["triton"] == tokens["reference"]
