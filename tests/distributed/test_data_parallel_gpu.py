"""Data-parallel replicas on CUDA (marked gpu; skipped without two CUDA devices): each replica's engine
process takes its own device (replica r on cuda:r with one rank each), and the two give one engine's
greedy tokens in fp32 for requests sent at once."""

from __future__ import annotations

import asyncio

import pytest
import torch

from helpers.tiny_models import make_tiny_model
from micro_vllm import LLM, SamplingParams
from micro_vllm.engine.arg_utils import AsyncEngineArgs
from micro_vllm.engine.data_parallel import DataParallelAsyncLLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

SETTINGS = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8, block_size=16, num_blocks=64)
PROMPTS = [[(11 * i + j) % 200 + 3 for j in range(5 + 7 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_two_replicas_take_a_device_each_and_give_one_engines_tokens(tmp_path):
    model = str(make_tiny_model("llama", tmp_path))
    free_before = [torch.cuda.mem_get_info(device)[0] for device in range(2)]
    engine = DataParallelAsyncLLM.from_engine_args(AsyncEngineArgs(model=model, data_parallel_size=2, **SETTINGS))
    try:
        taken = [before - torch.cuda.mem_get_info(device)[0] for device, before in enumerate(free_before)]

        async def generate(index: int) -> list[int]:
            outputs = [output async for output in engine.generate({"prompt_token_ids": PROMPTS[index]}, GREEDY,
                                                                   str(index))]
            return [token for output in outputs for token in output.outputs[0].token_ids]

        async def main():
            return await asyncio.gather(*map(generate, range(len(PROMPTS))))

        tokens = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(size > 2**27 for size in taken), taken  # a CUDA context, the weights and the cache on each
    with LLM(model=model, **SETTINGS) as llm:
        expected = [output.outputs[0].token_ids for output in llm.generate(
            [{"prompt_token_ids": prompt} for prompt in PROMPTS], GREEDY, use_tqdm=False)]
    assert tokens == [list(ids) for ids in expected]
