"""The attention backend interface and the registry that maps a name to an implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from micro_vllm.attention.attention import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention: write a step's K/V into the cache, then attend over the cached context.

    ``kv_cache`` is [2, num_blocks, block_size, num_kv_heads, head_size] (keys, then values).
    ``forward`` takes ``query`` [T, num_heads, head_size] and returns the same shape; rows past
    ``metadata.num_actual_tokens`` (padding) may hold anything.
    """

    name: str
    # True when forward reads per-step sizes only from device tensors, so a CUDA graph captured for
    # one decode batch replays correctly for any context lengths.
    cuda_graph_safe: bool = False

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Whether this backend serves attention heads of ``head_size`` channels (as vLLM's backends
        say which head sizes they take); the worker checks it once, at start-up."""
        return True

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...

    def write_and_attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """What a layer runs each step (vLLM's ``AttentionImpl.forward``): the step's K/V into the
        cache, then attention. A backend that can do both in fewer launches overrides it."""
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        return self.forward(query, kv_cache, metadata, scale=scale, sliding_window=sliding_window)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(cls):
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_backend(name: str) -> AttentionBackend:
    _import_builtin_backends()
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not supported; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def backends_supporting(head_size: int) -> list[str]:
    """The names of the backends that serve heads of ``head_size`` channels."""
    _import_builtin_backends()
    return sorted(name for name, cls in _BACKENDS.items() if cls.supports_head_size(head_size))


def _import_builtin_backends() -> None:
    # Imported lazily so that a missing optional dependency (Triton) only matters when it is chosen.
    from micro_vllm.attention.operators import reference, sdpa  # noqa: F401

    try:
        from micro_vllm.attention.operators import triton_attn  # noqa: F401
    except ImportError:
        pass
