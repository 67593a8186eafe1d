"""Rotary position embedding (RoPE) for flat query/key tensors, with the RoPE settings of HF configs.

Supports the original RoPE and Llama 3's frequency scaling (``rope_type: "llama3"``). Settings are read
from ``config.rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling`` (older configs).
CUDA tensors are rotated by one Triton launch for q and k (``triton_ops.rotary_embedding``); the
PyTorch code is its slow twin.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from micro_vllm.fused import fused_ops
from micro_vllm.layers.norm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one flat dict holding at least ``rope_type`` and ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {params}")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    # Configs written before transformers 4.45 spell the key "type".
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def inverse_frequencies(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    """One rotation frequency per pair of channels, in fp32: [head_size // 2]."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; choose one of {SUPPORTED_ROPE_TYPES}")
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 stretches long wavelengths (beyond what pretraining saw) by `factor`, keeps short ones,
    # and blends linearly in between, so nearby-token resolution survives a longer context.
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    original_len = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    long_wave = wavelength > original_len / low_freq_factor
    short_wave = wavelength < original_len / high_freq_factor
    return torch.where(long_wave, inv_freq / factor, torch.where(short_wave, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Rotates each head of flat q [T, H * D] and k [T, Hkv * D] by its token's position.

    Channel ``i`` pairs with channel ``i + D/2`` (the "rotate half" layout of HF Llama checkpoints).
    One instance is shared by all layers of a model.
    """

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = inverse_frequencies(head_size, params)
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Kept in fp32 and cast per step, as HF does, so bf16 runs round cos/sin the same way.
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    @classmethod
    def from_hf_config(cls, hf_config: Any, head_size: int) -> RotaryEmbedding:
        return cls(head_size, hf_config.max_position_embeddings, rope_parameters(hf_config))

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of ``query`` and ``key``; with ``q_norm`` and ``k_norm`` (Qwen3), each head
        is RMS-normalized first, in the same launch on CUDA."""
        if (ops := fused_ops(query)) is not None:
            norms = None if q_norm is None else ((q_norm.weight, q_norm.eps), (k_norm.weight, k_norm.eps))
            return ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size, norms)
        if q_norm is not None:
            query = q_norm(query.unflatten(-1, (-1, self.head_size))).flatten(-2)
            key = k_norm(key.unflatten(-1, (-1, self.head_size))).flatten(-2)
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, self.head_size))
        first, second = heads.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.flatten(-2)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.cos_sin_cache.shape[0]}"
