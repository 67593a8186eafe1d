"""Rotary position embedding (RoPE) for flat query/key tensors, with the RoPE settings of HF configs.

Supports the original RoPE and the frequency scalings ``linear``, ``dynamic`` (dynamic NTK), ``yarn``
and ``llama3``, each as transformers computes it. Settings are read from ``config.rope_parameters``
(transformers 5) or ``rope_theta`` / ``rope_scaling`` (older configs). ``RotaryEmbedding`` is a
CustomOp: ``forward_triton`` rotates q and k in one Triton launch (``triton_ops.rotary_embedding``),
``forward_native`` is the PyTorch code it is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from micro_vllm.layers.custom_op import CustomOp, triton_ops


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one flat dict holding at least ``rope_type`` and ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {params}")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    # Configs written before transformers 4.45 spell the key "type".
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    if params["rope_type"] == "yarn" and params.get("factor") is None:
        # YaRN may give its factor only as the ratio of the extended to the pretraining length.
        params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


def max_rope_position(hf_config: Any) -> int | None:
    """The longest context the config's RoPE serves, as vLLM derives it: ``linear`` stretches every
    position by ``factor`` and YaRN serves ``factor`` times its pretraining length, so both reach past
    ``max_position_embeddings``; the others end there (``dynamic``: see ``_dynamic_ntk``)."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is None:
        return None
    params = rope_parameters(hf_config)
    if params["rope_type"] == "linear":
        return int(limit * params["factor"])
    if params["rope_type"] == "yarn":
        return max(limit, int(params["original_max_position_embeddings"] * params["factor"]))
    return limit


def inverse_frequencies(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    """One rotation frequency per pair of channels, in fp32: [head_size // 2]."""
    rope_type = params["rope_type"]
    if rope_type not in _SCALINGS:
        raise ValueError(
            f"rope_type={rope_type!r} (in the config's rope_parameters / rope_scaling) is not supported; "
            f"choose one of {SUPPORTED_ROPE_TYPES}"
        )
    return _SCALINGS[rope_type](1.0 / _channel_periods(head_size, params), params)


def cos_sin_scale(params: dict[str, Any]) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention factor, which sharpens attention
    (it scales every q . k by its square), else 1."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    factor, mscale, mscale_all_dim = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek's form: a ratio of two temperatures
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _channel_periods(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    """theta ** (2i / D): each channel pair's wavelength over 2 pi, before any scaling."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    return float(params["rope_theta"]) ** exponents


def _unscaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    return inv_freq


def _linear_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Dividing every frequency by `factor` is dividing every position by it: position interpolation.
    return inv_freq / params["factor"]


def _dynamic_ntk(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Dynamic NTK: the original frequencies, which is what transformers uses up to
    ``max_position_embeddings``.

    transformers raises the base only once a forward pass reaches position
    ``max_position_embeddings``, and then from that pass's largest position, for every token of it: a
    token's rotation would depend on the batch it ran in, and keys cached before the switch would not
    match queries after it, so no paged KV cache can reproduce it. vLLM instead uses one base, the one
    for ``max_position_embeddings * factor`` tokens, at every position, which differs from
    transformers even on short sequences. Our cos/sin cache ends at ``max_position_embeddings`` and the
    engine refuses a longer ``max_model_len`` (``max_rope_position``), so the rescaling never applies and our tokens are
    transformers' at every length we accept; the price is that dynamic scaling extends no context.
    """
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


def _yarn_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # YaRN keeps the channels that turn more than `beta_fast` times over the pretraining length,
    # divides by `factor` those that turn fewer than `beta_slow` times, and ramps linearly between
    # the two channel indices (rounded outwards unless `truncate` is false).
    head_size, theta, factor = 2 * inv_freq.numel(), float(params["rope_theta"]), params["factor"]
    original_len = params["original_max_position_embeddings"]

    def channel_turning(turns: float) -> float:  # the (fractional) channel that turns `turns` times
        return head_size * math.log(original_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel_turning(params.get("beta_fast") or 32), channel_turning(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # a one-channel ramp would divide by zero
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    interpolated = 1.0 / (factor * _channel_periods(head_size, params))
    return interpolated * (1 - kept) + inv_freq * kept


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "default": _unscaled,
    "linear": _linear_scaled,
    "dynamic": _dynamic_ntk,
    "yarn": _yarn_scaled,
    "llama3": _llama3_scaled,
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = tuple(_SCALINGS)


class RotaryEmbedding(CustomOp):
    """Rotates each head of flat q [T, H * D] and k [T, Hkv * D] by its token's position.

    Channel ``i`` pairs with channel ``i + D/2`` (the "rotate half" layout of HF Llama checkpoints).
    One instance is shared by all layers of a model.
    """

    name = "rotary_embedding"

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = inverse_frequencies(head_size, params)
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Kept in fp32 and cast per step, as HF does, so bf16 runs round cos/sin the same way.
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1) * cos_sin_scale(params)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    @classmethod
    def from_hf_config(cls, hf_config: Any, head_size: int) -> RotaryEmbedding:
        return cls(head_size, max_rope_position(hf_config), rope_parameters(hf_config))

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of ``query`` and ``key``."""
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        # The query's and key's heads side by side in one new tensor, rotated in place, so one pass
        # of small ops rotates both and allocates only two half-width products.
        rotated = torch.cat((query, key), dim=-1)
        self._rotate_(rotated, cos, sin)
        return rotated.split((query.shape[-1], key.shape[-1]), dim=-1)

    def forward_triton(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size)

    def _rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """(first, second) -> (first * cos - second * sin, second * cos + first * sin) per head, in
        place, each product rounded before the sum as in transformers' rotate_half form."""
        # Two slices, not chunk(): autograd refuses in-place writes to the views of a multi-output op,
        # which matters when the model runs outside inference mode.
        heads, half = x.unflatten(-1, (-1, self.head_size)), self.head_size // 2
        first, second = heads[..., :half], heads[..., half:]
        second_sin, first_sin = second * sin, first * sin
        first.mul_(cos).sub_(second_sin)
        second.mul_(cos).add_(first_sin)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.cos_sin_cache.shape[0]}"
