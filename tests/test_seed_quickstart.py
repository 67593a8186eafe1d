"""The seed project's quick start runs as its README writes it (model path and device aside): a
float16 model on CPU runs in float32, with a warning, and the seed's `output_text` still reads the
first sequence's text beside vLLM's `outputs[0].text`."""

import logging

import pytest
import torch

from micro_vllm import CacheConfig, LLM, LLMConfig, ModelConfig, SamplingParams, SchedulerConfig
from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path

pytestmark = pytest.mark.real_model


def seed_quick_start(model: str) -> tuple[str, list[int]]:
    """The seed README's program, verbatim but for the model and the device, and a seed for the
    sampling so that its tokens can be compared; returns what it printed and the token ids."""
    llm = LLM(LLMConfig(
        model_config=ModelConfig(model=model, device="cpu", dtype=torch.float16),
        scheduler_config=SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=2),
        cache_config=CacheConfig(block_size=16, gpu_memory_utilization=0.8),
    ))
    try:
        outputs = llm.generate(["Paged attention is"], SamplingParams(max_tokens=16, temperature=0.7, seed=0))
        print(outputs[0].output_text)
        assert outputs[0].output_token_ids == outputs[0].outputs[0].token_ids
        assert outputs[0].finish_reason == outputs[0].outputs[0].finish_reason == "length"
        return outputs[0].output_text, outputs[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_seed_quick_start_runs_in_float32_on_cpu(caplog) -> None:
    try:
        model = str(default_model_path())
    except DefaultModelUnavailable as e:
        pytest.skip(f"default model unavailable: {e}")
    with caplog.at_level(logging.WARNING, logger="micro_vllm.worker.worker"):
        text, token_ids = seed_quick_start(model)
    assert any("float16" in r.getMessage() and "float32" in r.getMessage() for r in caplog.records)
    assert len(token_ids) == 16 and text.strip()
    # The same request in float32 gives the same tokens: float16 was run as float32, not as float16.
    with LLM(model=model, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=64,
             max_num_seqs=2, block_size=16) as llm:
        [out] = llm.generate(["Paged attention is"], SamplingParams(max_tokens=16, temperature=0.7, seed=0),
                             use_tqdm=False)
    assert out.outputs[0].token_ids == token_ids
    assert out.output_text == out.outputs[0].text == text
