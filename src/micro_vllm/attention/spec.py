"""What each attention layer needs from the KV cache, in plain Python.

The control plane (``micro_vllm.core``) groups layers by these specs without importing torch, so this
module must stay free of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    """The KV-cache needs of one attention layer.

    ``sliding_window`` is None for full attention; otherwise a query at position ``p`` sees the keys at
    positions ``p - sliding_window + 1 .. p`` (Hugging Face's convention), so blocks wholly before the
    window can be freed.
    """

    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"sliding_window({self.sliding_window})"
