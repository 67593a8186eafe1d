"""PyTorch's scaled_dot_product_attention over K/V gathered through the block table."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from micro_vllm.attention.attention import AttentionMetadata
from micro_vllm.attention.operators.reference import attention_mask, gather_context, write_kv_to_cache
from micro_vllm.attention.operators.registry import AttentionBackend, register_backend


@register_backend("sdpa")
class SdpaBackend(AttentionBackend):
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        write_kv_to_cache(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, metadata: AttentionMetadata, *, scale, sliding_window):
        output = torch.zeros_like(query)
        starts = metadata.query_start_loc_cpu.tolist()
        for i, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
            start, end = starts[i], starts[i + 1]
            keys, values = gather_context(kv_cache, metadata.block_table[i], seq_len)
            mask = attention_mask(end - start, seq_len, sliding_window, query.device)
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1),  # [heads, q, d]
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=keys.shape[1] != query.shape[1],
            )
            output[start:end] = out.transpose(0, 1)
        return output
