"""Maps a checkpoint's ``architectures[0]`` to the model class that runs it."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from micro_vllm.models.llama import LlamaForCausalLM
from micro_vllm.models.mistral import MistralForCausalLM
from micro_vllm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _MODELS[architecture]
