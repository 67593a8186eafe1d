"""Sliding windows on a KV cache smaller than one request: admission counts the window plus a step,
steps shrink until they fit, and the output is still transformers' token for token."""

import pytest
import torch

from micro_vllm import LLM, SamplingParams
from micro_vllm.trace import TraceConfig
from helpers.trace import ListSink
from helpers.tiny_models import load_hf_reference, make_tiny_model, tiny_config

BLOCK_SIZE = 4
PROMPT = [(i * 37) % 250 for i in range(40)]
NUM_NEW_TOKENS = 40
FULL_LENGTH_BLOCKS = (len(PROMPT) + NUM_NEW_TOKENS) // BLOCK_SIZE  # per KV cache group


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _llm(path, num_blocks, trace=None, **overrides):
    return LLM(model=str(path), device="cpu", dtype="float32", attention_backend="reference", max_model_len=128,
               block_size=BLOCK_SIZE, num_blocks=num_blocks, trace=trace, **overrides)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    return {family: make_tiny_model(family, root) for family in ("mistral", "qwen3_sliding")}


@pytest.fixture(scope="module")
def hf_greedy(model_dirs):
    """Transformers' own greedy generation (its sliding-window cache), never stopping at EOS."""
    with torch.no_grad():
        return {
            family: load_hf_reference(path).generate(
                torch.tensor([PROMPT]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None
            )[0, len(PROMPT):].tolist()
            for family, path in model_dirs.items()
        }


# (family, num_blocks, max_num_batched_tokens): mistral's one group is windowed; qwen3_sliding's
# layer 0 is full attention, whose group holds all 20 blocks. The default budget (16384) leaves it
# to the cache to shrink the steps; a budget of 8 leaves room the window must not take.
CASES = [
    ("mistral", 6, None),
    ("mistral", 12, 8),
    ("qwen3_sliding", 1 + FULL_LENGTH_BLOCKS + 4, None),
    ("qwen3_sliding", 1 + FULL_LENGTH_BLOCKS + 10, 8),
]


@pytest.mark.parametrize("family, num_blocks, budget", CASES)
def test_request_longer_than_the_cache_matches_transformers(model_dirs, hf_greedy, family, num_blocks, budget):
    path = model_dirs[family]
    config = tiny_config(family)
    num_full_groups = int(family == "qwen3_sliding")
    assert num_blocks - 1 < (1 + num_full_groups) * FULL_LENGTH_BLOCKS  # a fraction of what it needs in all
    sink = ListSink()
    overrides = {} if budget is None else dict(max_num_batched_tokens=budget)
    with _llm(path, num_blocks, TraceConfig(sink, level="block"), **overrides) as llm:
        [output] = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True),
                                use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy[family]

    # The blocks it held at every moment, in the order the trace recorded them.
    held = peak = largest_step = 0
    for event in sink.events:
        if event["event"] == "step" and event["requests"]:
            largest_step = max(largest_step, event["requests"][0]["tokens"])
        elif event["event"] in ("allocated", "hit"):
            held += len(event["block_ids"])
        elif event["event"] == "freed":
            held -= len(event["block_ids"])
        peak = max(peak, held)
    assert held == 0
    # A window's keys start anywhere in a block: the window less the query, plus the step, plus one.
    window_bound = cdiv(config.sliding_window - 1 + largest_step, BLOCK_SIZE) + 1
    assert peak <= num_full_groups * FULL_LENGTH_BLOCKS + window_bound
    if budget is not None:
        assert largest_step == budget and peak < num_blocks - 1  # the window left free blocks alone


@pytest.mark.parametrize("family, num_blocks, chunked", [
    ("mistral", 3, True),  # a window of 8 spans 3 blocks of 4 even for a one-token step
    ("mistral", 12, False),  # without chunked prefill the prompt is one step
    ("qwen3_sliding", FULL_LENGTH_BLOCKS + 3, True),  # 20 for the full layers, 3 for the window: 1 short
])
def test_request_that_can_never_fit_is_refused_up_front(model_dirs, family, num_blocks, chunked):
    with _llm(model_dirs[family], num_blocks, enable_chunked_prefill=chunked, max_num_batched_tokens=128) as llm:
        with pytest.raises(ValueError, match="can never fit"):
            llm.generate([PROMPT], SamplingParams(max_tokens=NUM_NEW_TOKENS), use_tqdm=False)


@pytest.mark.parametrize("family", ["mistral", "qwen3_sliding"])
def test_cpu_cache_is_sized_by_what_a_window_holds(model_dirs, family):
    """Without num_blocks, the CPU cache holds what max_num_seqs requests could hold at once: a
    windowed group counts the window plus a step, not the whole max_model_len."""
    window = tiny_config(family).sliding_window
    max_model_len, budget, max_num_seqs = 128, 8, 3
    full_groups = int(family == "qwen3_sliding")
    per_request = full_groups * cdiv(max_model_len, BLOCK_SIZE) + cdiv(window - 1 + budget, BLOCK_SIZE) + 1
    with LLM(model=str(model_dirs[family]), device="cpu", attention_backend="reference", max_model_len=max_model_len,
             block_size=BLOCK_SIZE, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs) as llm:
        assert llm.engine.num_blocks == max_num_seqs * per_request + 1
