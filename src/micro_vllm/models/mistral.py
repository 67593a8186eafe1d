"""Mistral: Llama with one sliding window (``config.sliding_window``, possibly None) on every layer."""

from __future__ import annotations

from transformers import PretrainedConfig

from micro_vllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_windows(cls, hf_config: PretrainedConfig) -> list[int | None]:
        return [getattr(hf_config, "sliding_window", None)] * hf_config.num_hidden_layers
