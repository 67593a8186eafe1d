"""Qwen2 and Qwen3: Llama with optional sliding windows on some layers; Qwen2 has a bias on its
q/k/v projections (none on the output projection), Qwen3 a per-head q/k RMSNorm before RoPE."""

from __future__ import annotations

from transformers import PretrainedConfig

from micro_vllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_windows(cls, hf_config: PretrainedConfig) -> list[int | None]:
        # As transformers does: the window applies only with use_sliding_window, and only on layers
        # typed "sliding_attention" (by default those from max_window_layers on).
        window = hf_config.sliding_window if getattr(hf_config, "use_sliding_window", False) else None
        num_layers = hf_config.num_hidden_layers
        first_sliding = hf_config.max_window_layers if window is not None else num_layers
        layer_types = getattr(hf_config, "layer_types", None) or [
            "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)
        ]
        return [window if kind == "sliding_attention" else None for kind in layer_types[:num_layers]]

    @classmethod
    def attention_biases(cls, hf_config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qk_norm = True

    @classmethod
    def attention_biases(cls, hf_config: PretrainedConfig) -> tuple[bool, bool]:
        # Qwen3 went back to Llama's switch: `attention_bias` on all four projections or none.
        return LlamaForCausalLM.attention_biases(hf_config)
