"""Every value is validated where it enters: each field of SamplingParams and of the configs, every
prompt form, chat messages and the model's files. A bad value raises an error that names the field
and the value before any work starts (no request queued, no step run), and the engine then gives
exactly a fresh engine's outputs. Values that pass must be ones the runner's arrays can hold."""

import dataclasses
import logging
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from micro_vllm import LLM, CacheConfig, LLMConfig, ModelConfig, SamplingParams, SchedulerConfig
from micro_vllm.config import CUSTOM_OPS, ParallelConfig
from micro_vllm.engine.arg_utils import EngineArgs
from micro_vllm.sampling.params import MAX_N
from micro_vllm.validation import FLOAT32_MAX, INT32_MAX, INT64_MAX
from helpers.tiny_models import VOCAB_SIZE, make_tiny_model

NAN, INF = math.nan, math.inf

# field -> values it must refuse; every field of SamplingParams appears (checked below).
BAD_SAMPLING_VALUES = {
    "n": [0, -1, MAX_N + 1, True, 2.0, "2", None],
    "max_tokens": [0, -3, True, 2.0, "3", None],
    "temperature": [-0.5, NAN, INF, -INF, 1e39, True, "1", None],
    "top_k": [-2, 2**31, True, 1.0, None],
    "top_p": [0.0, -0.1, 1.5, NAN, INF, True, "0.9", None],
    "seed": [-1, 2**63, True, 1.5, "7"],
    "ignore_eos": [1, 0, "yes", None],
    "stop_token_ids": [5, "5", b"\x05", [-1], [True], [1.0], None],
    "stop": ["", [""], ["ok", ""], 5, b"x", ["a", 3], [None]],
    "include_stop_str_in_output": [1, None, "yes"],
    "skip_special_tokens": [0, None],
    "spaces_between_special_tokens": [1, "no"],
    "detokenize": [0, None],
    "logprobs": [-2, 2**31, True, 1.0, "5"],
    "prompt_logprobs": [-2, 2**31, False, 0.0, "0"],
    "output_kind": [0, 2, "DELTA", "FINAL_ONLY", None],
    "structured_outputs": [{"json": {"type": "object"}}, '{"type": "object"}', 5],
    "presence_penalty": [-2.1, 2.5, NAN, INF, True, "0.1", None],
    "frequency_penalty": [-3, 2.01, NAN, -INF, False, None],
    "repetition_penalty": [0, 0.0, -1.0, NAN, INF, True, "1.1", None],
    "min_p": [-0.1, 1.1, NAN, True, "0.1", None],
    "min_tokens": [-1, 17, True, 1.0, "2", None],  # 17: more than the default max_tokens (16)
    "logit_bias": [{-1: 1.0}, {1: NAN}, {1: 100.5}, {1: -INF}, {True: 1.0}, {"1": 1.0}, {1.0: 1.0}, {1: "x"},
                   {1: True}, [1, 2], 5, "x"],
    "allowed_token_ids": [[], [-1], [1.5], [True], "abc", 5, {1: 2}],
    "bad_words": ["word", [""], ["ok", " \n"], [5], 5, b"x", [None]],
}

# (config class, field) -> values it must refuse; every field of every config appears.
BAD_CONFIG_VALUES = {
    (ModelConfig, "model"): [None, 5, "", b"m"],
    (ModelConfig, "tokenizer"): [5, "", b"t"],
    (ModelConfig, "device"): [None, "gpu", "cuda:x", 0],
    (ModelConfig, "dtype"): [None, "int8", torch.int8, 5],
    (ModelConfig, "attention_backend"): [5, ""],
    (ModelConfig, "seed"): [-1, 2**63, True, 1.5],
    (ModelConfig, "enforce_eager"): [1, "no", None],
    (ModelConfig, "max_logprobs"): [-2, None, True, 2**31, 20.0],
    (ModelConfig, "custom_ops"): ["all", 5, ["rms_norm"], ["+flash_attn"], ["+"], [""], [None], ["ALL"],
                                  ["all", "none"], ["+rms_norm", "-rms_norm"]],
    (ModelConfig, "hf_overrides"): ["x", 5, {1: 2}, ["a"]],
    (ModelConfig, "load_format"): ["pt", "DUMMY", None, 5],
    (ModelConfig, "generation_config"): ["", None, 5],
    (SchedulerConfig, "max_model_len"): [0, True, 2**31, 1.5, "64"],
    (SchedulerConfig, "max_num_batched_tokens"): [0, True, 2**31, None],
    (SchedulerConfig, "max_num_seqs"): [0, -1, True, 8.0],
    (SchedulerConfig, "enable_chunked_prefill"): [1, None],
    (SchedulerConfig, "async_scheduling"): [0, "yes"],
    (CacheConfig, "block_size"): [0, 12, True, 2**31, 16.0, None],
    (CacheConfig, "gpu_memory_utilization"): ["0.9", 0, 1.5, NAN, True, None],
    (CacheConfig, "num_blocks"): [1, True, 2.0, 2**31],
    (CacheConfig, "cpu_kv_cache_gib"): [0, -1, INF, NAN, "4", True],
    (CacheConfig, "enable_prefix_caching"): [1, None],
    (CacheConfig, "kv_cache_dtype"): ["fp16", "FP8", "fp8_e5m2", None, torch.float8_e4m3fn],
    (ParallelConfig, "tensor_parallel_size"): [0, -1, True, 2.0, "2", None],
    (ParallelConfig, "distributed_executor_backend"): ["RAY", "MP", "", 5],
    (ParallelConfig, "data_parallel_size"): [0, -1, True, 2.0, "2", None],
    (ParallelConfig, "data_parallel_rank"): [-1, 1, True, 0.0, None],  # 1: the one replica is 0
    (LLMConfig, "model_config"): ["m", None],
    (LLMConfig, "scheduler_config"): [{}],
    (LLMConfig, "cache_config"): [None],
    (LLMConfig, "parallel_config"): [{"tensor_parallel_size": 2}],
}
REQUIRED = {ModelConfig: dict(model="m"), LLMConfig: dict(model_config=ModelConfig(model="m"))}
NOT_CHECKED_HERE = {(LLMConfig, "trace")}  # resolved by the Engine (test_trace.py)


def named(field: str, value) -> str:
    """The start of the message every refusal gives."""
    return re.escape(f"{field}={value!r} is not allowed; it must be ")


def cases(table):
    return [pytest.param(key, value, id=f"{key}={value!r}") for key, values in table.items() for value in values]


# -- SamplingParams ----------------------------------------------------------------------------


def test_every_sampling_field_is_covered():
    assert {f.name for f in dataclasses.fields(SamplingParams)} == set(BAD_SAMPLING_VALUES)


@pytest.mark.parametrize("field, value", cases(BAD_SAMPLING_VALUES))
def test_bad_sampling_value_is_named(field, value):
    with pytest.raises(ValueError, match=named(field, value)):
        SamplingParams(**{field: value})


INT_FIELDS = {"n": (1, MAX_N), "max_tokens": (1, None), "top_k": (-1, INT32_MAX), "seed": (0, INT64_MAX),
              "logprobs": (-1, INT32_MAX), "prompt_logprobs": (-1, INT32_MAX)}
BOUNDARIES = [v + d for v in (-1, 0, 1, INT32_MAX, INT64_MAX, 2**64) for d in (-1, 0, 1)]


@pytest.mark.parametrize("field", INT_FIELDS)
@settings(max_examples=60, deadline=None)
@given(value=st.integers() | st.sampled_from(BOUNDARIES) | st.sampled_from([-v for v in BOUNDARIES]))
def test_integer_fields_take_exactly_their_range(field, value):
    low, high = INT_FIELDS[field]
    if low <= value and (high is None or value <= high):
        assert getattr(SamplingParams(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=named(field, value)):
            SamplingParams(**{field: value})


@settings(max_examples=80, deadline=None)
@given(temperature=st.floats() | st.sampled_from([FLOAT32_MAX, 1e39, 0.0, 1e-300]), top_p=st.floats())
def test_float_fields_take_exactly_their_range(temperature, top_p):
    ok_temperature = math.isfinite(temperature) and 0 <= temperature <= FLOAT32_MAX
    ok_top_p = 0 < top_p <= 1
    if ok_temperature and ok_top_p:
        params = SamplingParams(temperature=temperature, top_p=top_p)
        assert params.top_p == top_p
        assert params.temperature == (0 if temperature == 0 else max(temperature, 0.01))
    else:
        field, value = ("temperature", temperature) if not ok_temperature else ("top_p", top_p)
        with pytest.raises(ValueError, match=named(field, value)):
            SamplingParams(temperature=temperature, top_p=top_p)


def test_tiny_temperature_is_raised_to_the_minimum_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert SamplingParams(temperature=1e-40).temperature == 0.01
    assert "temperature=1e-40" in caplog.text


def test_stop_strings_are_kept_as_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()


def test_min_tokens_at_most_max_tokens():
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
    allowed = re.escape("an integer in [0, 3] (at most max_tokens=3)")
    with pytest.raises(ValueError, match=named("min_tokens", 4) + allowed):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_logits_processor_fields_are_normalized():
    params = SamplingParams(logit_bias={np.int64(5): np.float32(-1.5)}, allowed_token_ids=np.array([3, 4]),
                            bad_words=["a", "b", "a"])
    assert params.logit_bias == {5: -1.5} and type(next(iter(params.logit_bias))) is int
    assert params.allowed_token_ids == (3, 4) and params.bad_words == ("a", "b")


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match=r"stop=\['x'\] is not allowed with detokenize=False"):
        SamplingParams(stop="x", detokenize=False)


def test_the_last_sequence_seed_must_fit():
    """Sequence i of a seeded request samples with seed + i."""
    assert SamplingParams(n=3, seed=INT64_MAX - 2).seed == INT64_MAX - 2
    with pytest.raises(ValueError, match=rf"seed={INT64_MAX - 1} is not allowed with n=3"):
        SamplingParams(n=3, seed=INT64_MAX - 1)


def test_numpy_values_are_taken_as_python_numbers():
    params = SamplingParams(max_tokens=np.int64(3), top_k=np.int32(5), seed=np.uint64(7),
                            temperature=np.float32(0.5), stop_token_ids=np.array([1, 2]))
    assert (params.max_tokens, params.top_k, params.seed, params.stop_token_ids) == (3, 5, 7, (1, 2))
    assert all(type(v) is int for v in (params.max_tokens, params.top_k, params.seed, *params.stop_token_ids))


# -- configs -----------------------------------------------------------------------------------


def test_every_config_field_is_covered():
    every = {(cls, f.name) for cls in (ModelConfig, SchedulerConfig, CacheConfig, ParallelConfig, LLMConfig)
             for f in dataclasses.fields(cls)}
    assert every - NOT_CHECKED_HERE == set(BAD_CONFIG_VALUES)


@pytest.mark.parametrize("key, value", cases(BAD_CONFIG_VALUES))
def test_bad_config_value_is_named(key, value):
    cls, field = key
    with pytest.raises(ValueError, match=named(field, value)):
        cls(**{**REQUIRED.get(cls, {}), field: value})


def test_bad_custom_ops_entry_is_named_with_the_allowed_ops():
    with pytest.raises(ValueError, match=named("custom_ops", ["all", "-rmsnorm"])) as error:
        ModelConfig(model="m", custom_ops=["all", "-rmsnorm"])
    assert "(not '-rmsnorm')" in str(error.value)
    assert all(repr(op) in str(error.value) for op in CUSTOM_OPS)


def test_custom_ops_reach_the_model_config_as_a_tuple():
    config = EngineArgs(model="m", custom_ops=["none", "+sampler"]).create_engine_config()
    assert config.model_config.custom_ops == ("none", "+sampler")
    hash(config)  # a list would make the frozen config unhashable


def test_good_config_values_are_kept():
    assert ModelConfig(model="m", device="cuda:1", dtype=torch.bfloat16, seed=INT64_MAX).dtype == "bfloat16"
    assert SchedulerConfig(max_model_len=INT32_MAX, max_num_batched_tokens=np.int64(8)).max_num_batched_tokens == 8
    assert CacheConfig(block_size=2**30, gpu_memory_utilization=1, num_blocks=2).gpu_memory_utilization == 1.0
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=np.int64(2)).distributed_executor_backend == "mp"
    assert ParallelConfig(distributed_executor_backend="mp").tensor_parallel_size == 1


def test_parallel_config_refusals_say_why():
    with pytest.raises(ValueError, match=named("distributed_executor_backend", "uni") + ".*tensor_parallel_size is 2"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=named("device", "cuda:1") + ".*rank r runs on cuda:r"):
        EngineArgs(model="m", device="cuda:1", tensor_parallel_size=2).create_engine_config()
    assert EngineArgs(model="m", tensor_parallel_size=2).create_engine_config().parallel_config.world_size == 2
    with pytest.raises(ValueError, match=named("data_parallel_rank", 2) + r"an integer in \[0, 1\]"):
        ParallelConfig(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match=named("distributed_executor_backend", "ray") + ".*data_parallel_size=2"):
        ParallelConfig(data_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=named("device", "cuda:1") + r".*replica r runs on the devices from cuda:"):
        EngineArgs(model="m", device="cuda:1", data_parallel_size=2).create_engine_config()


def test_keyword_form_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=named("gpu_memory_utilization", "0.9")):
        LLM(model=str(tmp_path), gpu_memory_utilization="0.9")


@pytest.mark.parametrize("config", [123, {"model": "m"}, b"path"])
def test_llm_config_of_the_wrong_kind_is_named(config):
    with pytest.raises(TypeError, match=r"config=.* is not allowed; it must be an LLMConfig or a model path"):
        LLM(config)


# -- an engine that must stay untouched --------------------------------------------------------

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=3, ignore_eos=True)
GOOD_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], "hello there"]


def make_llm(path) -> LLM:
    return LLM(model=str(path), device="cpu", max_model_len=64, block_size=8, max_num_batched_tokens=32)


def tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(GOOD_PROMPTS, [GREEDY, SEEDED], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("validation"))


@pytest.fixture(scope="module")
def fresh_tokens(model_dir):
    with make_llm(model_dir) as fresh:
        return tokens(fresh)


@pytest.fixture(scope="module")
def llm(model_dir):
    with make_llm(model_dir) as llm:
        yield llm


@pytest.fixture
def untouched(llm, monkeypatch):
    """Yields the LLM; afterwards checks that no step ran and that nothing is queued or held (the
    last test of the file then checks that the outputs are still a fresh engine's)."""
    engine = llm.engine
    steps = []
    execute_model = engine.executor.execute_model
    monkeypatch.setattr(engine.executor, "execute_model", lambda plan: steps.append(plan) or execute_model(plan))
    yield llm
    assert steps == [] and not engine.scheduler.requests and not engine.in_flight and not engine.prompts
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


GOOD = [5, 6, 7]
BAD_PROMPTS = [
    (None, TypeError, named("prompts", None)),
    (123, TypeError, named("prompts", 123)),
    (1.5, TypeError, named("prompts", 1.5)),
    (b"abc", TypeError, named("prompts", b"abc")),
    ([True, False], TypeError, named("prompt_token_ids", [True, False])),
    ([GOOD, [1, True]], TypeError, named("prompt_token_ids", [1, True])),
    ([GOOD, [1, 2.0]], TypeError, named("prompt_token_ids", [1, 2.0])),
    ([GOOD, np.array([[1, 2]])], TypeError, r"prompt_token_ids=array\(\[\[1, 2\]\]\) is not allowed"),
    ([GOOD, np.array([1.0, 2.0])], TypeError, r"prompt_token_ids=array\(\[1\., 2\.\]\) is not allowed"),
    ([GOOD, np.array([True, False])], TypeError, r"prompt_token_ids=array\(\[ True, False\]\) is not allowed"),
    ([GOOD, None], TypeError, named("prompt", None)),
    ([GOOD, 3.5], TypeError, named("prompt", 3.5)),
    ({"prompt_token_ids": None}, TypeError, named("prompt_token_ids", None)),
    ({"prompt_token_ids": "abc"}, TypeError, named("prompt_token_ids", "abc")),
    ({"prompt_token_ids": [1], "prompt": 7}, TypeError, named("prompt", 7)),
    ({"prompt": 5}, TypeError, named("prompt", 5)),
    ({"prompt": None}, ValueError, named("prompt", {"prompt": None})),
    ({"text": "x"}, ValueError, named("prompt", {"text": "x"})),
    ([GOOD, [np.int64(VOCAB_SIZE)]], ValueError, rf"prompt_token_ids contain \[{VOCAB_SIZE}\] outside the vocabulary"),
    ([GOOD, {"prompt_token_ids": [2**40]}], ValueError, rf"\[{2**40}\] outside the vocabulary"),
    ([GOOD, ""], ValueError, r"prompt '' is empty"),
]


@pytest.mark.parametrize("prompts, error, match", BAD_PROMPTS, ids=[repr(p[0]) for p in BAD_PROMPTS])
def test_bad_prompt_is_refused_before_any_work(untouched, prompts, error, match):
    with pytest.raises(error, match=match):
        untouched.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "sampling_params, match",
    [
        (5, named("sampling_params", 5)),
        ({"max_tokens": 3}, named("sampling_params", {"max_tokens": 3})),
        ([GREEDY, "x"], r"sampling_params='x' is not allowed"),
        ("greedy", named("sampling_params", "greedy")),  # a string is one value, not a list of six
    ],
)
def test_bad_sampling_params_argument_is_refused_before_any_work(untouched, sampling_params, match):
    with pytest.raises(TypeError, match=match):
        untouched.generate([GOOD, GOOD], sampling_params, use_tqdm=False)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [21, -1])
def test_logprobs_over_max_logprobs_are_refused_before_any_work(untouched, field, value):
    """vLLM's default cap of 20 (ModelConfig.max_logprobs); -1 asks for the whole vocabulary."""
    with pytest.raises(ValueError, match=named(field, value) + rf"None or an integer in \[0, 20\]: "
                       rf"ModelConfig.max_logprobs is 20 and the vocabulary has {VOCAB_SIZE} tokens"):
        untouched.generate([GOOD], SamplingParams(**{field: value}), use_tqdm=False)


def test_max_logprobs_minus_one_allows_the_whole_vocabulary_and_no_more(model_dir):
    with LLM(model=str(model_dir), device="cpu", max_model_len=64, max_logprobs=-1) as llm:
        with pytest.raises(ValueError, match=named("logprobs", VOCAB_SIZE + 1) + rf"None or an integer in "
                           rf"\[0, {VOCAB_SIZE}\], or -1 \(the whole vocabulary\)"):
            llm.generate([GOOD], SamplingParams(logprobs=VOCAB_SIZE + 1), use_tqdm=False)
        out = llm.generate([GOOD], SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=VOCAB_SIZE),
                           use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == VOCAB_SIZE
    assert all(len(position) == VOCAB_SIZE for position in out.prompt_logprobs[1:])


@pytest.mark.parametrize(
    "field, ids",
    [("logit_bias", {5: 1.0, VOCAB_SIZE: 2.0}), ("allowed_token_ids", [3, 2**40, VOCAB_SIZE + 1])],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_any_work(untouched, field, ids):
    bad = [t for t in ids if t >= VOCAB_SIZE]
    with pytest.raises(ValueError, match=rf"{field} contain {re.escape(str(bad))} outside the vocabulary; "
                                         rf"allowed ids are 0..{VOCAB_SIZE - 1}"):
        untouched.generate([GOOD, GOOD], [GREEDY, SamplingParams(**{field: ids})], use_tqdm=False)


CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "messages, match",
    [
        (CONVERSATION[0], named("messages", CONVERSATION[0])),
        ("hi", named("messages", "hi")),
        (None, named("messages", None)),
        ([CONVERSATION, "hi"], r"messages=.* is not allowed; it must be a conversation"),
        ([{"role": "user"}], r"messages contain \{'role': 'user'\}; each message must be"),
        ([{"role": 1, "content": "x"}], r"messages contain \{'role': 1, 'content': 'x'\}"),
        ([[1]], r"messages contain 1; each message must be"),
    ],
)
def test_bad_chat_messages_are_refused_before_any_work(untouched, messages, match):
    with pytest.raises(TypeError, match=match):
        untouched.chat(messages, GREEDY, use_tqdm=False)


def test_numpy_prompts_are_token_ids(llm, fresh_tokens):
    as_numpy = [np.array(GOOD_PROMPTS[0]), {"prompt_token_ids": [np.int32(t) for t in GOOD_PROMPTS[0]]}]
    outputs = llm.generate(as_numpy, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [GOOD_PROMPTS[0]] * 2
    assert [o.outputs[0].token_ids for o in outputs] == [fresh_tokens[0]] * 2  # GOOD_PROMPTS[0], greedy


def test_extreme_allowed_values_run(llm):
    """The bounds validation allows fit the runner's int32 / int64 / float32 arrays."""
    extreme = [SamplingParams(max_tokens=3, seed=INT64_MAX, top_k=INT32_MAX, ignore_eos=True),
               SamplingParams(max_tokens=3, seed=0, temperature=FLOAT32_MAX, top_p=1e-30, ignore_eos=True),
               SamplingParams(max_tokens=2**100, temperature=0.01, stop_token_ids=[2**62])]
    outputs = llm.generate([GOOD] * 3, extreme, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs[:2]] == [3, 3]


# -- files -------------------------------------------------------------------------------------


def test_missing_tokenizer_directory_is_named(model_dir):
    with pytest.raises(ValueError, match=named("tokenizer", "/nonexistent")):
        LLM(model=str(model_dir), device="cpu", tokenizer="/nonexistent")
    with LLM(model=str(model_dir), device="cpu", max_model_len=64, tokenizer=str(model_dir)) as llm:
        assert llm.tokenizer is not None


def rewrite_weights(path, change):
    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, path / "model.safetensors")


def test_corrupt_safetensors_file_is_named(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(OSError, match=re.escape(f"{file} is not a readable safetensors file")):
        LLM(model=str(path), device="cpu")


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("model.layers.1.mlp.down_proj.weight", (64, 100), (64, 128)),
        ("model.layers.0.self_attn.k_proj.weight", (3, 64), (64, 64)),  # one piece of the fused qkv_proj
    ],
)
def test_misshaped_tensor_is_named_with_both_shapes(tmp_path, name, shape, expected):
    path = make_tiny_model("llama", tmp_path)
    rewrite_weights(path, lambda w: w.update({name: torch.zeros(shape)}))
    with pytest.raises(ValueError, match=re.escape(name) + rf".*{re.escape(str(shape))}.*{re.escape(str(expected))}"):
        LLM(model=str(path), device="cpu")


def test_unexpected_tensors_warn_by_name_and_change_nothing(tmp_path, model_dir, fresh_tokens, caplog):
    path = make_tiny_model("llama", tmp_path)  # tied: it needs no lm_head.weight
    extra = {"model.layers.0.mlp.extra.weight": torch.zeros(2), "model.rotary_emb.inv_freq": torch.zeros(2),
             "lm_head.weight": torch.zeros(2)}
    rewrite_weights(path, lambda w: w.update(extra))
    with caplog.at_level(logging.WARNING, logger="micro_vllm.model_loader"), make_llm(path) as llm:
        assert tokens(llm) == fresh_tokens
    [record] = [r for r in caplog.records if "checkpoint tensors" in r.getMessage()]
    assert record.getMessage().endswith("ignored: model.layers.0.mlp.extra.weight")  # the others are skipped by design


def test_after_every_refusal_outputs_are_a_fresh_engines(llm, fresh_tokens):
    # Runs after the refusals above, on the same LLM.
    assert tokens(llm) == fresh_tokens
