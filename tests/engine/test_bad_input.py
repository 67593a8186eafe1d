"""Every bad input gets an error naming the field, the value and what is allowed, before any work
starts, and the engine stays usable."""

import json
import sys

import pytest

from micro_vllm import LLM, CacheConfig, SamplingParams, SchedulerConfig
from micro_vllm.attention.backends.registry import backends_supporting
from helpers.tiny_models import VOCAB_SIZE, make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bad"))
    return LLM(model=str(path), device="cpu", max_model_len=64, block_size=8, max_num_batched_tokens=32)


GOOD = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), r"max_tokens=0 .*>= 1"),
        (dict(max_tokens=-3), r"max_tokens=-3"),
        (dict(temperature=-0.5), r"temperature=-0.5 .*\[0, .*0 means greedy"),
        (dict(top_p=0.0), r"top_p=0.0 .*\(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5"),
        (dict(top_k=-2), r"top_k=-2 .*0 / -1"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_k", [0, -1, 1, 50])
def test_sampling_params_accepts_top_k_off_and_on(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", r"is empty"),
        ([], r"is empty"),
        ({"prompt_token_ids": []}, r"is empty"),
        ([1, 2, VOCAB_SIZE], rf"\[{VOCAB_SIZE}\] outside the vocabulary; allowed ids are 0..{VOCAB_SIZE - 1}"),
        ([-1, 5], r"\[-1\] outside the vocabulary"),
        (list(range(64)), r"64 tokens leaves no room.*max_model_len=64.*at most 63"),
        ({"text": "x"}, r"a dict with 'prompt_token_ids' or 'prompt'"),
    ],
)
def test_bad_prompts_raise_before_work_and_engine_survives(llm, prompt, match):
    good_prompt = [5, 6, 7]
    with pytest.raises(ValueError, match=match):
        llm.generate([good_prompt, prompt], GOOD, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good prompt was not queued either
    [output] = llm.generate([good_prompt], GOOD, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_prompt_plus_max_tokens_beyond_max_model_len_is_not_an_error(llm):
    [output] = llm.generate([list(range(60))], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 4


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match=r"sampling_params has 2 entries for 3 prompts"):
        llm.generate([[1], [2], [3]], [GOOD, GOOD], use_tqdm=False)


def test_unknown_keyword(tmp_path):
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['max_batch'\].*allowed"):
        LLM(model=str(tmp_path), max_batch=3)


@pytest.mark.parametrize("block_size", [0, -16, 12, 3.0])
def test_block_size_must_be_power_of_two(block_size):
    with pytest.raises(ValueError, match=rf"block_size={block_size!r} .*positive power of two"):
        CacheConfig(block_size=block_size)


def test_token_budget_too_small_to_make_progress():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=0"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=32 is too small.*max_model_len \(64\)"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_max_model_len_beyond_the_model(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len=100000 .*at most 256"):
        LLM(model=str(path), device="cpu", max_model_len=100000)


def test_model_directory_errors(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist"):
        LLM(model=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"config.json"):
        LLM(model=str(tmp_path / "empty"))
    path = make_tiny_model("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen3ForCausalLM"):
        LLM(model=str(path), device="cpu")


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("llama", tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight"):
        LLM(model=str(path), device="cpu")


def test_unknown_attention_backend(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match=r"attention_backend='flash' .*reference.*sdpa"):
        LLM(model=str(path), device="cpu", attention_backend="flash")


def _unimportable(monkeypatch, module: str) -> None:
    """Make ``module`` fail to import, and the triton backend's module import afresh."""
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, "micro_vllm.attention.backends.triton_attn", raising=False)


def test_a_backend_whose_dependency_is_missing_is_refused_by_name(tmp_path, monkeypatch):
    _unimportable(monkeypatch, "triton")
    assert backends_supporting(64) == ["reference", "sdpa"]
    path = make_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match=r"attention_backend='triton' needs the module 'triton', which is not "
                                         r"installed; install it or choose one of \['reference', 'sdpa'\]"):
        LLM(model=str(path), device="cpu", attention_backend="triton")


def test_a_broken_backend_module_fails_loudly(monkeypatch):
    """Triton is installed but the backend cannot import a part of it: an error, not "unsupported"."""
    pytest.importorskip("triton")
    _unimportable(monkeypatch, "triton.language")
    with pytest.raises(ModuleNotFoundError, match="triton.language"):
        backends_supporting(64)


def test_request_that_can_never_fit_in_the_cache(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    llm = LLM(model=str(path), device="cpu", max_model_len=64, block_size=8, num_blocks=4)
    with pytest.raises(ValueError, match=r"can never fit"):
        llm.generate([[1] * 40], SamplingParams(max_tokens=10), use_tqdm=False)
    [ok] = llm.generate([[1] * 10], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 10


def test_stop_strings_and_bad_words_need_a_tokenizer(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"):
        (path / name).unlink(missing_ok=True)
    with LLM(model=str(path), device="cpu", max_model_len=64, block_size=8) as llm:
        for name in ("stop", "bad_words"):
            params = SamplingParams(max_tokens=4, **{name: ["x"]})
            with pytest.raises(ValueError, match=rf"{name}=\['x'\] is not allowed: this model has no tokenizer"):
                llm.generate([[5, 6, 7], [5, 6]], [GOOD, params], use_tqdm=False)
            assert not llm.engine.has_unfinished_requests()
        [output] = llm.generate([[5, 6, 7]], GOOD, use_tqdm=False)  # token ids only, as before
        assert output.outputs[0].text == "" and len(output.outputs[0].token_ids) == 4
