"""The ground-truth backend: plain PyTorch, one request at a time, written to be read.

Every faster backend is tested against this one.
"""

from __future__ import annotations

import torch

from micro_vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata, to_cache_dtype


def write_kv_to_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter each token's K/V to its slot; slots of -1 (padding) are skipped."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0, slots] = to_cache_dtype(key[:num_tokens][valid], kv_cache.dtype)
    flat[1, slots] = to_cache_dtype(value[:num_tokens][valid], kv_cache.dtype)


def gather_context(kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a request's first ``seq_len`` keys and values through its block table row."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_row[:num_blocks].long()
    keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_size]
    values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return keys, values


def attention_mask(query_len: int, seq_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """True where a query may see a key: causal, and inside the window when there is one."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


class ReferenceBackend(AttentionBackend):
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        write_kv_to_cache(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, metadata: AttentionMetadata, *, scale, sliding_window):
        common = metadata.common
        output = torch.zeros_like(query)
        num_heads = query.shape[1]
        starts = common.query_start_loc_cpu.tolist()
        for i, seq_len in enumerate(common.seq_lens_cpu.tolist()):
            start, end = starts[i], starts[i + 1]
            keys, values = gather_context(kv_cache, common.block_table[i], seq_len)
            group = num_heads // keys.shape[1]  # query heads per KV head
            keys = keys.repeat_interleave(group, dim=1).float()
            values = values.repeat_interleave(group, dim=1).float()
            q = query[start:end].float()
            scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
            mask = attention_mask(end - start, seq_len, sliding_window, query.device)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            output[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
        return output
