"""The multiprocess executor on CUDA (marked gpu; skipped without CUDA): with one rank, a world of its
own over NCCL (its start-up and first collective in the worker process), it gives the in-process
executor's tokens, greedy and seeded, with CUDA graphs and async scheduling on; where two GPUs are
lent, two ranks give one rank's greedy tokens in fp32, their all-reduces captured in the graphs."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.core_helpers import token_ids
from helpers.tiny_models import make_tiny_model
from micro_vllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Prompts that cross blocks and chunks; a step budget that chunks them; a cache that holds them all.
SETTINGS = dict(device="cuda", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=16, block_size=16,
                num_blocks=16 * 16 * 2 + 1)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (1, 7, 23, 37, 61, 100, 150, 12)]
# Greedy and seeded sampling, alternately.
PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Head size 128, GQA 2, q/k norm, untied: the shape of the benchmark model's layers, smaller.
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("gpu_tp"), hidden_size=256, intermediate_size=512,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           tie_word_embeddings=False)


def run(model_dir, params, **settings) -> list[list[int]]:
    with LLM(model=str(model_dir), **{**SETTINGS, **settings}) as llm:
        return token_ids(llm.generate(PROMPTS, params, use_tqdm=False))


def test_one_rank_in_a_worker_process_over_nccl_gives_the_in_process_tokens(model_dir):
    assert run(model_dir, PARAMS, distributed_executor_backend="mp") == run(model_dir, PARAMS)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_give_one_ranks_greedy_tokens_in_fp32(model_dir):
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert run(model_dir, greedy, dtype="float32", tensor_parallel_size=2) == run(model_dir, greedy, dtype="float32")
