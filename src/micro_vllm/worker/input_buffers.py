"""A step's inputs staged on the host and copied to the device, and the one place that turns the
staged attention inputs into each layer's metadata: for normal steps, CUDA graph capture and the
start-up runs alike."""

from __future__ import annotations

import torch

from micro_vllm.attention.attention import Attention
from micro_vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer


class InputBuffers:
    """The token ids, positions and attention inputs of steps of up to ``max_num_reqs`` requests and
    ``max_num_tokens`` tokens, with a block table and a slot mapping per KV cache group, and each
    group's metadata builder."""

    def __init__(self, layers: list[Attention], backend: AttentionBackend, groups: list[KVCacheGroup],
                 max_num_reqs: int, max_num_tokens: int, max_model_len: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks = self.num_cols(max_model_len)
        staged = lambda *shape, dtype=torch.int32: CpuGpuBuffer(shape, dtype, device)  # noqa: E731
        self.input_ids = staged(max_num_tokens, dtype=torch.int64)
        self.positions = staged(max_num_tokens, dtype=torch.int64)
        self.query_start_loc = staged(max_num_reqs + 1)
        self.seq_lens = staged(max_num_reqs)
        self.block_tables = [staged(max_num_reqs, max_blocks) for _ in groups]
        self.slot_mappings = [staged(max_num_tokens, dtype=torch.int64) for _ in groups]
        # A group's layers share their heads and cache dtype: its first layer tells them.
        first_layers = [layers[group.layer_indices[0]] for group in groups]
        self.builders = [
            backend.builder_cls(group.spec, layer.num_heads, block_size, max_num_reqs, device, layer.kv_cache.dtype,
                                dtype)
            for group, layer in zip(groups, first_layers)
        ]
        self.layer_group = [0] * len(layers)  # decoder layer -> its KV cache group
        for group_id, group in enumerate(groups):
            for layer_index in group.layer_indices:
                self.layer_group[layer_index] = group_id

    def num_cols(self, max_seq_len: int) -> int:
        """The block-table columns that contexts of up to ``max_seq_len`` tokens reach."""
        return -(-max_seq_len // self.block_size)

    def attention_metadata(self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
                           num_cols: int) -> list[AttentionMetadata]:
        """Copy the staged attention inputs of a step to the device (of the block tables only the
        first ``num_cols`` columns, those the step's contexts reach) and build each decoder layer's
        metadata: each KV cache group's common metadata, from which the group's builder builds the
        backend's."""
        query_start_loc = self.query_start_loc.copy_to_device(num_reqs + 1)
        seq_lens = self.seq_lens.copy_to_device(num_reqs)
        per_group = [
            builder.build(CommonAttentionMetadata(
                num_actual_tokens=num_tokens,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_table=block_table.copy_to_device(num_reqs, num_cols),
                slot_mapping=slot_mapping.copy_to_device(num_tokens),
                query_start_loc_cpu=self.query_start_loc.host_rows(num_reqs + 1),
                seq_lens_cpu=self.seq_lens.host_rows(num_reqs),
            ))
            for builder, block_table, slot_mapping in zip(self.builders, self.block_tables, self.slot_mappings)
        ]
        return [per_group[g] for g in self.layer_group]
