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

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int, block_size: int) -> int:
        """The most blocks one request of ``num_tokens`` holds at once in a layer of this spec, when a
        step computes at most ``max_chunk_tokens`` of it (vLLM's ``KVCacheSpec.max_memory_usage``).
        Full attention keeps every block; a window only the window before the step and the step."""
        all_blocks = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return all_blocks
        return min(all_blocks, -(-(self.sliding_window - 1 + max_chunk_tokens) // block_size) + 1)
