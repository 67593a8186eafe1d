"""Typed, validated configuration: what the user asks for, checked before any work starts.

Configs are frozen; values that depend on the machine or the checkpoint ("auto" device, dtype,
backend) are resolved by the layer that owns them (the Worker), not written back here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run, where, and how its attention is computed."""

    model: str
    tokenizer: str | None = None  # defaults to the model directory
    device: str = "auto"  # "auto" picks cuda when present, else cpu
    dtype: Any = "auto"  # a torch.dtype or one of _DTYPES; auto: bf16 on CUDA, fp32 on CPU
    attention_backend: str | None = None  # reference | sdpa | triton; None picks per device
    seed: int = 0
    enforce_eager: bool = False  # True turns CUDA graphs off

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is not allowed; give a model directory or a hub id")
        if not isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not allowed; choose one of {_DTYPES}")
        if self.device != "auto" and not self.device.split(":")[0] in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not allowed; choose 'auto', 'cpu' or 'cuda[:N]'")


@dataclass(frozen=True)
class SchedulerConfig:
    """The budgets of one engine step (vLLM's names and meanings)."""

    max_model_len: int | None = None  # prompt + output; None takes the model's max_position_embeddings
    # vLLM's defaults for offline use on a large GPU: room for every request of a big batch at once.
    max_num_batched_tokens: int = 16384  # tokens computed in one step, prefill chunks and decodes together
    max_num_seqs: int = 1024  # requests running at once
    enable_chunked_prefill: bool = True
    # Plan step N+1 while the device runs step N; a request that stops early costs one wasted token.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is too small to make progress: without "
                f"chunked prefill it must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, how much memory it takes, prefix caching."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use in all
    num_blocks: int | None = None  # an explicit capacity, overriding the sizing
    cpu_kv_cache_gib: float = 4.0  # the KV budget on CPU
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size={bs!r} is not allowed; it must be a positive power of two")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r} is not allowed; it must be in (0, 1]"
            )
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise ValueError(f"num_blocks={self.num_blocks!r} is not allowed; it must be an integer >= 2")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib={self.cpu_kv_cache_gib!r} is not allowed; it must be > 0")


@dataclass(frozen=True)
class LLMConfig:
    """Everything an engine needs, grouped the way vLLM groups it."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    trace: Any = None  # a JSON-lines path or an object with emit(event); None turns tracing off

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> LLMConfig:
        """Build from flat keywords (vLLM's ``LLM(model=..., max_model_len=...)`` form)."""
        parts: dict[str, dict[str, Any]] = {}
        for part, part_cls in _SECTIONS.items():
            names = {f.name for f in dataclasses.fields(part_cls)}
            parts[part] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        trace = kwargs.pop("trace", None)
        if kwargs:
            allowed = sorted(f.name for c in _SECTIONS.values() for f in dataclasses.fields(c)) + ["trace"]
            raise TypeError(f"unknown keyword(s) {sorted(kwargs)} for LLM; allowed: {allowed}")
        return cls(
            model_config=ModelConfig(model=model, **parts["model_config"]),
            scheduler_config=SchedulerConfig(**parts["scheduler_config"]),
            cache_config=CacheConfig(**parts["cache_config"]),
            trace=trace,
        )


_SECTIONS = {"model_config": ModelConfig, "scheduler_config": SchedulerConfig, "cache_config": CacheConfig}
