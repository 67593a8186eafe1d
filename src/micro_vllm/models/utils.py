"""What the engine reads from a Hugging Face config the same way for every model family."""

from __future__ import annotations

from transformers import PretrainedConfig


def head_size_of(hf_config: PretrainedConfig) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config: PretrainedConfig) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
