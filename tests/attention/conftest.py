"""Each attention test draws a fresh seed (printed; MICRO_VLLM_TEST_SEED replays one)."""

import os
import random

import pytest
import torch


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("MICRO_VLLM_TEST_SEED", 0)) or int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed} (replay with MICRO_VLLM_TEST_SEED={seed})")
    torch.manual_seed(seed)
    return random.Random(seed)
