"""The default model (SmolLM2-135M-Instruct, converted from the GGUF in a PyPI wheel) loads with plain
transformers and answers sensibly; the conversion is cached."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from micro_vllm.model_loader.default_model_download import DEFAULT_MODEL, DefaultModelUnavailable, default_model_path

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:
        return default_model_path()
    except DefaultModelUnavailable as e:  # no PyPI access, or gguf/accelerate missing
        pytest.skip(f"default model unavailable: {e}")


def test_directory_is_a_plain_hf_model(model_dir: Path) -> None:
    assert model_dir.name.startswith(DEFAULT_MODEL)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in keys and len(keys) == 272  # tied: the embedding is stored once
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model_dir / name).is_file(), name


def test_answers_capital_of_france(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0, :2].tolist() != [ids[0, 0].item()] * 2  # no doubled BOS
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:])
    assert "Paris" in answer, answer


def test_cache_is_reused(model_dir: Path) -> None:
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_llm_answers_paris_and_matches_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from micro_vllm import LLM, SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(model=str(model_dir), device="cpu", max_model_len=512) as llm:
        [output] = llm.chat(messages, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert "Paris" in output.outputs[0].text, output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].stop_reason is None  # EOS, not a stop token or string
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = model.generate(torch.tensor([output.prompt_token_ids]), max_new_tokens=20, do_sample=False)
    assert output.outputs[0].token_ids == expected[0, len(output.prompt_token_ids):].tolist()


def test_cli_generates_with_the_default_model(model_dir: Path, capsys) -> None:
    from micro_vllm.cli import main

    assert main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out
