"""The vocabulary's layers under tensor parallelism (vLLM's names): the token embedding and the LM head.

Both split the vocabulary's rows evenly over the ranks, after padding it to a multiple of their
number: rank r holds tokens ``r * rows .. (r + 1) * rows - 1``. ``VocabParallelEmbedding`` looks up
the ids of its rows (the others give zeros) and an all-reduce sums the ranks' lookups.
``ParallelLMHead`` computes the logits of its rows and all-gathers them, so every rank holds the
whole vocabulary's logits and samples the same tokens (as vLLM V1 does); the padding is cut off.
With one rank both are a plain embedding and a plain linear layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from micro_vllm.distributed import GroupCoordinator, get_tp_group
from micro_vllm.layers.linear import LinearBase
from micro_vllm.model_loader.weight_utils import Shard, ShardedWeightLoader


def vocab_shard(num_embeddings: int, tp_group: GroupCoordinator) -> Shard:
    """The rows of the vocabulary this rank holds, padded to a multiple of the ranks (the last
    rank's may run past ``num_embeddings``)."""
    rows = -(-num_embeddings // tp_group.world_size)
    return Shard(0, tp_group.rank_in_group * rows, rows, num_embeddings)


class VocabParallelEmbedding(nn.Module):
    """The token embedding, each rank holding its rows of the vocabulary (``vocab_shard``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.num_embeddings = num_embeddings
        self.shard = vocab_shard(num_embeddings, self.tp_group)
        self.weight = nn.Parameter(torch.zeros(self.shard.size, embedding_dim))  # the padding rows stay zero
        self.weight.weight_loader = ShardedWeightLoader(0, {None: self.shard})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.shard.start
        outside = (local_ids < 0) | (local_ids >= self.shard.size)
        embeddings = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embeddings.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(embeddings)


class ParallelLMHead(LinearBase):
    """The output projection to the vocabulary: each rank's logits for its rows, all-gathered along
    the vocabulary. ``tied_to`` reuses an embedding's weight (``tie_word_embeddings``): the two split
    the vocabulary alike, so the rank's rows are the same tensor, and the head's own is never allocated."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        tp_group = get_tp_group()
        shard = vocab_shard(num_embeddings, tp_group)
        super().__init__(embedding_dim, shard.size, bias=False, device="meta" if tied_to is not None else None)
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight.weight_loader = ShardedWeightLoader(0, {None: shard})

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.tp_group.all_gather(self.matmul(hidden_states, None))
        if logits.shape[-1] == self.num_embeddings:
            return logits
        return logits[..., : self.num_embeddings].contiguous()
