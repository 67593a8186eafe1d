"""CUDA graphs of decode steps: the batch sizes that get one, their capture, and replaying a step
padded to the next captured size."""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch
from torch import nn

from micro_vllm.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

MAX_CUDA_GRAPH_BATCH = 512  # larger decode batches run eagerly


def cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    # Past a few hundred decodes launch overhead is a small share of a step (vLLM stops at 512 too).
    limit = min(max_num_seqs, MAX_CUDA_GRAPH_BATCH)
    sizes = [1, 2, 4, 8] + list(range(16, limit + 1, 16))
    return sorted({s for s in sizes if s <= limit} | {limit})


def pad_decode_batch(buffers: InputBuffers, num_reqs: int, size: int) -> None:
    """Stage rows ``num_reqs..size`` of a decode step (request i's one token is token i) as dummy
    decodes that read the null block and write nowhere: a graph runs the batch size it was captured
    with."""
    buffers.query_start_loc.np[num_reqs : size + 1] = np.arange(num_reqs, size + 1)
    buffers.seq_lens.np[num_reqs:size] = 1
    buffers.input_ids.np[num_reqs:size] = 0
    buffers.positions.np[num_reqs:size] = 0
    for block_table, slot_mapping in zip(buffers.block_tables, buffers.slot_mappings):
        block_table.np[num_reqs:size, 0] = 0
        slot_mapping.np[num_reqs:size] = -1


class CudaGraphs:
    """The captured decode graphs by batch size, each with the output tensor its replays fill."""

    def __init__(self) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []

    @torch.inference_mode()
    def capture(self, model: nn.Module, buffers: InputBuffers, sizes: list[int], max_model_len: int) -> None:
        """Capture one graph per decode batch size, largest first so smaller ones reuse its memory.

        A graph bakes in its kernels and buffer addresses, not sequence lengths: the attention backend
        reads those from the device, so one graph serves every decode step of its size."""
        pool = None
        for size in sorted(sizes, reverse=True):
            pad_decode_batch(buffers, 0, size)
            metadata = buffers.attention_metadata(size, size, max_query_len=1, max_seq_len=max_model_len, num_cols=1)
            args = (buffers.input_ids.copy_to_device(size), buffers.positions.copy_to_device(size), metadata)
            model(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden_states = model(*args)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden_states)
        torch.cuda.synchronize()
        self.sizes = sorted(self.graphs)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def size_for(self, num_reqs: int, num_tokens: int) -> int | None:
        """The smallest captured batch that holds this step, when the step is all decodes."""
        if not self.graphs or num_tokens != num_reqs:
            return None
        index = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def replay(self, size: int, num_reqs: int) -> torch.Tensor:
        """Run the graph of ``size`` on the staged step (padded to ``size``): the hidden states of its
        first ``num_reqs`` rows, the real ones."""
        graph, hidden_states = self.graphs[size]
        graph.replay()
        return hidden_states[:num_reqs]
