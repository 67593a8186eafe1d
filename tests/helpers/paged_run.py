"""Drive one of our models through paged attention without a ModelRunner, as the runner does:
``bind_backend`` gives its layers a backend, ``layer_metadata`` builds a step's metadata, and
``PagedRun`` gives each request its own scattered blocks and runs steps. Used to compare our models
with transformers, and a model split over tensor-parallel ranks with the whole one (this module
imports no transformers: the ranks' processes start faster)."""

from __future__ import annotations

import random

import torch

from torch import nn

from micro_vllm.attention.backends.abstract import AttentionMetadata, CommonAttentionMetadata
from micro_vllm.attention.backends.registry import get_backend_cls

NUM_BLOCKS = 32


def bind_backend(model: nn.Module, backend: str) -> nn.Module:
    """Give every attention layer of ``model`` one instance of ``backend``, as the ModelRunner does
    (the caller binds the KV caches)."""
    instance = get_backend_cls(backend)()
    for layer in model.attention_layers():
        layer.backend = instance
    return model


def layer_metadata(model: nn.Module, common: CommonAttentionMetadata, block_size: int) -> list[AttentionMetadata]:
    """Each decoder layer's metadata for one step: what its backend's builder builds from ``common``
    (the runner builds it once per KV cache group, whose layers share a spec)."""
    return [
        layer.backend.builder_cls(layer.spec, layer.num_heads, block_size, common.num_reqs, common.seq_lens.device,
                                  layer.kv_cache.dtype, next(model.parameters()).dtype)
        .build(common)
        for layer in model.attention_layers()
    ]


class PagedRun:
    """Drives a model the way the ModelRunner will: own blocks per request, metadata built by hand."""

    def __init__(self, model: torch.nn.Module, num_reqs: int, block_size: int, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(blocks)  # scattered, so block-table indexing is really exercised
        per_req = NUM_BLOCKS // num_reqs
        self.block_table = torch.tensor([blocks[i * per_req : (i + 1) * per_req] for i in range(num_reqs)])
        self.num_computed = [0] * num_reqs
        dtype = next(model.parameters()).dtype
        for attn in model.attention_layers():
            spec = attn.spec
            shape = (2, NUM_BLOCKS, block_size, spec.num_kv_heads, spec.head_size)
            attn.kv_cache = torch.zeros(shape, dtype=dtype)

    def step(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """Compute the next ``chunks[i]`` tokens of request i; returns each request's logits [len, vocab]."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for i, chunk in enumerate(chunks):
            start = self.num_computed[i]
            for pos in range(start, start + len(chunk)):
                block = int(self.block_table[i, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
            ids += chunk
            positions += range(start, start + len(chunk))
            query_lens.append(len(chunk))
            seq_lens.append(start + len(chunk))
            self.num_computed[i] += len(chunk)
        query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_actual_tokens=len(ids),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_table=self.block_table.to(torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_t,
        )
        with torch.inference_mode():
            metadata = layer_metadata(self.model, common, self.block_size)
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), metadata)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))
