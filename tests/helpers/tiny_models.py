"""Tiny random Hugging Face models of every supported family, for tests across the repo.

``make_tiny_model(family, tmp_path)`` writes a complete model directory (config.json, safetensors,
and a byte-level tokenizer) and returns it; ``load_hf_reference(path)`` loads the same directory
with transformers, as the reference our outputs are compared with. Everything is seeded, so the
same family and overrides always give the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)


BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
VOCAB_SIZE = 260  # 256 byte tokens, <s>, </s>, two unused ids

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
)

# family -> (config class, what it varies). GQA ratios: llama 1, llama_untied 2, llama3_rope 4,
# llama_rope_linear 2, llama_rope_dynamic 1, mistral 2, qwen2 2, qwen2_sliding 4, qwen2_rope_yarn 2,
# qwen3 4, qwen3_sliding 2. Of the RoPE scalings, linear and yarn change the rotation at every
# position; dynamic is the plain RoPE up to max_position_embeddings, the longest we run (see
# _dynamic_ntk in layers/rotary.py), so its family checks that it stays so.
_FAMILIES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama_untied": (
        LlamaConfig,
        dict(num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    ),
    "llama3_rope": (
        LlamaConfig,
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=False,
            # Wavelengths of head_dim 16 span all three llama3 bands with this original length.
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "llama_rope_linear": (
        LlamaConfig,
        dict(num_key_value_heads=2, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    ),
    "llama_rope_dynamic": (
        LlamaConfig,
        dict(num_key_value_heads=4, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)),
    ),
    "mistral": (MistralConfig, dict(num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),  # q/k/v bias, none on o_proj
    "qwen2_sliding": (
        Qwen2Config,
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,  # layer 0 full attention, layer 1 sliding
        ),
    ),
    "qwen2_rope_yarn": (
        Qwen2Config,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            # With head_dim 16, YaRN's ramp runs over channels 0-3 of 8 at this original length; the
            # attention factor (from `factor`) scales cos/sin.
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64
            ),
        ),
    ),
    "qwen3": (
        Qwen3Config,
        dict(
            num_key_value_heads=1,
            head_dim=32,  # != hidden_size / num_attention_heads
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
    ),
    "qwen3_sliding": (
        Qwen3Config,
        dict(
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,  # layer 0 full attention, layer 1 sliding
        ),
    ),
}

FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    config_class, family_kwargs = _FAMILIES[family]
    return config_class(**{**_COMMON, **family_kwargs, **overrides})


def build_tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random fp32 HF model in eval mode, with eager attention (the plainest reference)."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _spread_weights(model, seed)
    return model.eval()


def make_tiny_model(
    family: str,
    tmp_path: Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random model directory under ``tmp_path`` and return it.

    ``max_shard_size`` (e.g. "40KB") writes a sharded checkpoint with ``model.safetensors.index.json``.
    """
    model = build_tiny_hf_model(family, seed=seed, **overrides)
    path = Path(tmp_path) / (name or (family if max_shard_size is None else f"{family}-sharded"))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def load_hf_reference(path: Path) -> PreTrainedModel:
    """The saved model, loaded back by transformers in fp32 with eager attention."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: token id = byte value, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    vocab.update({"<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for bytes, which the ByteLevel pre-tokenizer emits.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


@torch.no_grad()
def _spread_weights(model: PreTrainedModel, seed: int) -> None:
    # HF's default init (std 0.02) gives near-uniform logits that hide most bugs under any tolerance;
    # unit-scale activations make every layer matter.
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if "norm" in name:
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            param.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            # Tied models read logits off the embedding: a unit-scale embedding would dominate the
            # residual stream and the model would only echo its last token, whatever attention did.
            param.copy_(noise * (0.05 if model.config.tie_word_embeddings else 1.0))
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Import into a test module to run it on one torch thread: tiny matmuls gain nothing from
    threads, and on a small shared CPU spinning threads slow every step by orders of magnitude."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
