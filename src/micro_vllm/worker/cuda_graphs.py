"""CUDA graphs of whole steps (vLLM's FULL cudagraphs): the step shapes that get one, the padding
that fits a step into a captured shape, their capture, and replay.

Two kinds of shape: decode batches (one token per request) up to ``MAX_CUDA_GRAPH_BATCH`` requests,
and steps with prefill chunks (alone or mixed with decodes) up to ``MAX_MIXED_GRAPH_TOKENS`` tokens.
Launching a step's few hundred kernels from Python takes about as long as the GPU work of a
several-thousand-token prefill of a small model, and on a slower host longer, so graphs pay up to
the default token budget.

Under tensor parallelism every rank captures the same shapes in the same order, and a graph holds the
model's all-reduces and all-gather like any kernel: NCCL's communicator already exists (the worker
ran its group's first collective when it joined), so no capture creates one.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from micro_vllm.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

MAX_CUDA_GRAPH_BATCH = 512  # larger decode batches run eagerly
MAX_MIXED_GRAPH_TOKENS = 16384  # larger steps with prefill chunks run eagerly
# The smallest decode graph: fewer requests pad up to it, since cuBLAS's kernels for one- to
# few-row matmuls are slower on Hopper than its kernels for eight rows.
MIN_DECODE_GRAPH_BATCH = 8
# Token counts of the mixed graphs: powers of two from here up. No smaller: a query bound of at least
# this many tokens takes the attention's general prefill tiles whatever the heads.
MIN_MIXED_GRAPH_TOKENS = 32
# Request slots of a mixed graph, on a coarser ladder than decode batches: a spare slot costs only a
# program that finds no query, but each size is a graph per token count.
MIXED_GRAPH_REQUEST_SLOTS = (4, 16, 64, 256)


@dataclass(frozen=True, order=True)
class CudaGraphShape:
    """The step a graph was captured for (vLLM: BatchDescriptor): its tokens, request slots and
    longest query.

    Equal counts make a decode graph: one query per request, the attention's decode path. Otherwise
    the graph serves steps with prefill chunks: its metadata states ``max_query_len``, a bound on the
    longest query that every step it serves meets, so the attention takes its general path (prefill
    tiles, grid from tokens and requests alone) and one graph serves any mix of query lengths
    within the bound."""

    num_tokens: int
    num_reqs: int
    max_query_len: int

    @property
    def uniform_decode(self) -> bool:
        return self.num_tokens == self.num_reqs

    def fits(self, num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
        """Whether a step of this many requests and tokens, and this longest query, pads to this
        shape: a decode batch to a decode graph; a step with prefill chunks to a mixed graph with a
        request slot to spare, the last one, which takes the padding tokens."""
        if num_tokens == num_reqs:
            return self.uniform_decode and num_reqs <= self.num_reqs
        return (not self.uniform_decode and num_tokens <= self.num_tokens and num_reqs < self.num_reqs
                and max_query_len <= self.max_query_len)


def cudagraph_capture_shapes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                             long_query_len: int | None = None) -> list[CudaGraphShape]:
    """The decode batch sizes (vLLM's ``cudagraph_capture_sizes``) and the mixed-step shapes that
    get a graph: steps up to these limits replay one, larger ones run eagerly.

    A mixed graph bounds its longest query by its token count, or by ``max_model_len`` when that is
    less (no query is longer). From ``long_query_len`` on, the attention backend takes other tiles
    (``AttentionBackend.long_query_len``): a token count whose bound reaches it gets a second graph
    bounded below it, so a long step of short prompts keeps the tiles of short prompts."""
    # Past a few hundred decodes launch overhead is a small share of a step (vLLM stops at 512 too).
    limit = min(max_num_seqs, MAX_CUDA_GRAPH_BATCH)
    sizes = {s for s in [MIN_DECODE_GRAPH_BATCH, *range(16, limit + 1, 16)] if s <= limit} | {limit}
    shapes = [CudaGraphShape(size, size, 1) for size in sorted(sizes)]
    # A mixed step has more tokens than requests; one needing more than half its token count in
    # slots (its requests and the padding's dummy, one slot past max_num_seqs at most) fits the next
    # token count up.
    token_limit = min(max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS)
    token_counts = {token_limit} if token_limit >= MIN_MIXED_GRAPH_TOKENS else set()
    num_tokens = MIN_MIXED_GRAPH_TOKENS
    while num_tokens < token_limit:
        token_counts.add(num_tokens)
        num_tokens *= 2
    for num_tokens in sorted(token_counts):
        slots = min(num_tokens // 2, max_num_seqs + 1)
        bound = min(num_tokens, max_model_len)
        bounds = [long_query_len - 1, bound] if long_query_len is not None and bound >= long_query_len else [bound]
        for num_reqs in sorted({s for s in MIXED_GRAPH_REQUEST_SLOTS if s < slots} | {slots}):
            shapes.extend(CudaGraphShape(num_tokens, num_reqs, max_query_len) for max_query_len in bounds)
    return shapes


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


def pad_mixed_batch(buffers: InputBuffers, num_reqs: int, num_tokens: int, shape: CudaGraphShape) -> None:
    """Stage a step with prefill chunks as ``shape``: its padding tokens form a dummy prompt in the
    last request slot, which reads only the null block and writes nowhere, and the slots between
    hold requests without a query, which the attention skips. The dummy prompt is at most the
    shape's longest query (itself at most ``max_model_len``, all a block-table row reaches); padding
    tokens past it belong to no request, so the attention leaves their rows alone, and every other
    op works row by row."""
    last = shape.num_reqs - 1
    dummy_len = min(shape.num_tokens - num_tokens, shape.max_query_len)
    buffers.query_start_loc.np[num_reqs : shape.num_reqs] = num_tokens
    buffers.query_start_loc.np[shape.num_reqs] = num_tokens + dummy_len
    buffers.seq_lens.np[num_reqs:last] = 0
    buffers.seq_lens.np[last] = dummy_len
    buffers.input_ids.np[num_tokens : shape.num_tokens] = 0
    buffers.positions.np[num_tokens : shape.num_tokens] = 0
    for block_table, slot_mapping in zip(buffers.block_tables, buffers.slot_mappings):
        block_table.np[last] = 0
        slot_mapping.np[num_tokens : shape.num_tokens] = -1


def pad_batch(buffers: InputBuffers, num_reqs: int, num_tokens: int, shape: CudaGraphShape) -> None:
    """Stage the rows of a step past its ``num_reqs`` requests and ``num_tokens`` tokens so that it
    runs as ``shape``."""
    if shape.uniform_decode:
        pad_decode_batch(buffers, num_reqs, shape.num_reqs)
    else:
        pad_mixed_batch(buffers, num_reqs, num_tokens, shape)


class CudaGraphs:
    """The captured graphs by step shape, each with the output tensor its replays fill."""

    def __init__(self) -> None:
        self.graphs: dict[CudaGraphShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.shapes: list[CudaGraphShape] = []  # smallest first

    @torch.inference_mode()
    def capture(self, model: nn.Module, buffers: InputBuffers, shapes: list[CudaGraphShape]) -> None:
        """Capture one graph per shape, largest first so smaller ones reuse its memory.

        A graph bakes in its kernels and buffer addresses, not sequence or query lengths: the
        attention backend reads those from the device, so one graph serves every step its shape
        fits."""
        pool, max_model_len = None, buffers.max_model_len
        for shape in sorted(shapes, reverse=True):
            pad_batch(buffers, 0, 0, shape)
            metadata = buffers.attention_metadata(
                shape.num_reqs, shape.num_tokens, shape.max_query_len, max_model_len,
                num_cols=buffers.num_cols(min(shape.num_tokens, max_model_len)),
            )
            args = (buffers.input_ids.copy_to_device(shape.num_tokens),
                    buffers.positions.copy_to_device(shape.num_tokens), metadata)
            model(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden_states = model(*args)
            pool = graph.pool()
            self.graphs[shape] = (graph, hidden_states)
        torch.cuda.synchronize()
        self.shapes = sorted(self.graphs)
        logger.info("captured CUDA graphs for decode batch sizes %s and (tokens, requests) of mixed steps %s",
                    [s.num_reqs for s in self.shapes if s.uniform_decode],
                    [(s.num_tokens, s.num_reqs, s.max_query_len) for s in self.shapes if not s.uniform_decode])

    def shape_for(self, num_reqs: int, num_tokens: int, max_query_len: int) -> CudaGraphShape | None:
        """The smallest captured shape this step pads to, if any (of two that differ only in their
        query bound, the lower)."""
        if not self.shapes:  # eager
            return None
        first = bisect.bisect_left(self.shapes, CudaGraphShape(num_tokens, 0, 0))
        return next((shape for shape in self.shapes[first:] if shape.fits(num_reqs, num_tokens, max_query_len)), None)

    def replay(self, shape: CudaGraphShape, num_tokens: int) -> torch.Tensor:
        """Run the graph of ``shape`` on the staged step (padded to it): the hidden states of its
        first ``num_tokens`` rows, the real ones."""
        graph, hidden_states = self.graphs[shape]
        graph.replay()
        return hidden_states[:num_tokens]
