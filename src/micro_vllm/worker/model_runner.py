"""Runs one step on one device: applies the plan to the persistent batch, stages the step's inputs,
runs the model (through a CUDA graph when one was captured for a shape the step pads to) and samples.

The runner never sees Request objects: it learns everything from the plans, token values included (a
new request's tokens, then each step's ``new_token_ids``), and keeps the rest in its ``InputBatch``,
whose first rows are the step's requests. ``execute_model`` only launches the step: the sampled
tokens come back through the returned ``AsyncModelRunnerOutput``, so the engine can plan the next
step while the GPU works. They also stay on the device (``prev_sampled_token_ids``, vLLM's name): a
request whose newest token the last step sampled takes it from there as its next input, before the
host has seen it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from micro_vllm.attention.backends.abstract import AttentionMetadata
from micro_vllm.attention.backends.registry import get_backend_cls
from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.core.kv_cache_manager import KVCacheGroup, make_kv_cache_groups
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer
from micro_vllm.model_loader.checkpoint import load_model
from micro_vllm.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata
from micro_vllm.worker.cuda_graphs import CudaGraphs, CudaGraphShape, cudagraph_capture_shapes, pad_batch
from micro_vllm.worker.dummy_run import warm_up, warm_up_allocators
from micro_vllm.worker.input_batch import InputBatch, TokenCounts
from micro_vllm.worker.input_buffers import InputBuffers
from micro_vllm.worker.prompt_logprobs import PromptLogprobs, PromptLogprobsSlice
from micro_vllm.worker.step_output import DeviceStepOutput


@dataclass(frozen=True)
class RunnerSettings:
    """What the runner needs to know, resolved by the Worker."""

    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    attention_backend: str
    custom_ops: frozenset[str]  # the ops that run their Triton kernel (resolve_custom_ops)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    seed: int
    use_cuda_graphs: bool
    load_format: str = "auto"  # ModelConfig.load_format: "dummy" builds the model with random weights


@dataclass(frozen=True)
class StepInputs:
    """One step's inputs on the device, in the order of the batch's rows."""

    num_reqs: int
    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]  # one per decoder layer
    # The last token of each request, whose logits it samples from; None when it is the only one.
    logits_indices: torch.Tensor | None
    # Per request, whether its sample is a new token (the step reaches the end of the tokens it
    # knows); else it computes a prompt chunk and its sample is dropped.
    samples: np.ndarray
    sampling_metadata: SamplingMetadata | None  # None: a start-up run, which samples on its own
    cuda_graph_shape: CudaGraphShape | None  # the captured shape the step is padded to and replays; None: eager
    prompt_logprobs: list[PromptLogprobsSlice]  # empty unless a request of the step asks for prompt logprobs
    prompt_logprob_targets: torch.Tensor | None  # per step token, the prompt token it predicts (in the slices)


def _inference_mode(method):
    """``@torch.inference_mode()`` without its Python ``__enter__``: that one turns the mode on and
    keeps torch's guard on the context object, so a Ctrl-C landing before it returned left the mode
    on until the KeyboardInterrupt's traceback was freed, and freeing it then turned the mode off
    wherever the program was (in a later step, a RuntimeError). Here the guard is a temporary of the
    ``with`` line itself: an interrupt before the ``with`` holds it frees it, and the mode with it, at once."""

    @functools.wraps(method)
    def in_inference_mode(*args, **kwargs):
        with torch._C._InferenceMode(True):
            return method(*args, **kwargs)

    return in_inference_mode


class ModelRunner:
    def __init__(self, settings: RunnerSettings, model_path, hf_config) -> None:
        self.settings = settings
        self.device = settings.device
        # Building the modules draws their initial weights (overwritten by the checkpoint) from
        # torch's global RNG: the caller's RNG state must not change.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.model = load_model(model_path, hf_config, settings.dtype, settings.device, settings.custom_ops,
                                    settings.load_format, settings.seed)
        self.attn_backend = get_backend_cls(settings.attention_backend)()
        for layer in self.model.attention_layers():
            layer.backend = self.attn_backend
        self.sampler = Sampler("sampler" in settings.custom_ops, settings.seed, self.device, settings.max_num_seqs)
        self.vocab_size = hf_config.vocab_size
        self.cuda_graphs = CudaGraphs()
        # Marks when the last step's host-to-device copies finished: the host must not refill the
        # staged buffers before then (nothing else waits for the GPU between steps). Every copy of a
        # step is queued before its forward pass, so the wait never covers GPU compute.
        self.copies_done = torch.cuda.Event() if self.device.type == "cuda" else None
        # The last step's sampled tokens (one per row), and the row there of each request whose
        # sample was a new token: the next step's input for it.
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] = {}

    # -- set-up --------------------------------------------------------------------------------

    def get_attention_specs(self) -> list[AttentionSpec]:
        return [layer.spec for layer in self.model.attention_layers()]

    def kv_cache_bytes_per_block(self) -> int:
        element = self.settings.kv_cache_dtype.itemsize
        return sum(
            2 * self.settings.block_size * spec.num_kv_heads * spec.head_size * element
            for spec in self.get_attention_specs()
        )

    def on_demand_bytes(self) -> int:
        """The device memory the runner allocates only when a request first needs it, which the KV
        cache's sizing must leave free: the penalties' token counts (``TokenCounts``, a row of the
        vocabulary for every request slot)."""
        return TokenCounts.nbytes(self.settings.max_num_seqs, self.vocab_size)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Give each layer a paged K/V tensor of ``num_blocks`` blocks (0: none)."""
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(2, num_blocks, self.settings.block_size, layer.num_kv_heads,
                                         layer.head_size, dtype=self.settings.kv_cache_dtype, device=self.device)
            # Every slot is written before it is read, except the null block that stands in for
            # positions outside a sliding window (and pads CUDA-graph batches): masked, but
            # multiplied by zero, so it must hold no NaN.
            layer.kv_cache[:, :1].zero_()

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        """Allocate each layer's paged K/V tensor, the persistent batch and the step buffers; then
        (on CUDA) warm up, capture CUDA graphs and warm up the allocators for serving."""
        settings = self.settings
        self.allocate_kv_cache(num_blocks)
        max_blocks = -(-settings.max_model_len // settings.block_size)
        max_reqs, max_tokens = settings.max_num_seqs, max(settings.max_num_batched_tokens, settings.max_num_seqs)
        self.input_batch = InputBatch(max_reqs, settings.max_model_len, [max_blocks] * len(groups), self.vocab_size,
                                      self.device)
        # One request slot more than can run, for the dummy prompt that pads a step to a CUDA graph.
        self.buffers = InputBuffers(self.model.attention_layers(), self.attn_backend, groups, max_reqs + 1,
                                    max_tokens, settings.max_model_len, settings.block_size, self.device, settings.dtype)
        self.logits_indices = CpuGpuBuffer((max_reqs,), torch.int64, self.device)
        self.prev_token_dst = CpuGpuBuffer((max_reqs,), torch.int64, self.device)  # step tokens that take ...
        self.prev_token_src = CpuGpuBuffer((max_reqs,), torch.int64, self.device)  # ... the last step's tokens
        # A structured-output step's bitmask goes over from pinned memory: a copy from pageable memory
        # would wait for the step in flight and lose async scheduling's overlap.
        self.grammar_bitmask = CpuGpuBuffer((max_reqs, -(-self.vocab_size // 32)), torch.int32, self.device)
        self.prompt_logprobs = PromptLogprobs(max_tokens, self.device)
        if self.device.type == "cuda":
            warm_up(self)
        if settings.use_cuda_graphs:
            shapes = cudagraph_capture_shapes(settings.max_num_seqs, settings.max_num_batched_tokens,
                                              settings.max_model_len, self.attn_backend.long_query_len)
            self.cuda_graphs.capture(self.model, self.buffers, shapes)
        if self.device.type == "cuda":
            warm_up_allocators(self)

    # -- one step ------------------------------------------------------------------------------

    def reset_batch(self) -> None:
        """Forget every request after a failed step: the persistent batch empties, and the tokens
        of the steps launched (which the scheduler will never see) are not read by the next."""
        self.input_batch.clear()
        self.prompt_logprobs.clear()
        self.prev_sampled_token_ids = None
        self.prev_req_id_to_index = {}

    @_inference_mode
    def execute_model(self, plan: SchedulerOutput) -> DeviceStepOutput:
        """Launch the plan's step; its tokens arrive through the returned handle."""
        if self.copies_done is not None:  # the batch and the step buffers are about to be refilled
            self.copies_done.synchronize()
        self.update_states(plan)
        if plan.is_empty:
            return DeviceStepOutput([], np.empty(0, bool), None)
        inputs = self.prepare_inputs(plan)
        hidden_states = self.run_model(inputs)
        sampled = self.sample(hidden_states, inputs)
        prompt_logprobs = {}
        if inputs.prompt_logprobs:
            prompt_logprobs = self.prompt_logprobs.compute(inputs.prompt_logprobs, inputs.prompt_logprob_targets,
                                                           hidden_states, self.compute_logits)
        return self._launched(inputs, sampled, prompt_logprobs)

    def update_states(self, plan: SchedulerOutput) -> None:
        """Apply the plan's deltas to the persistent batch: requests that left, new ones, the step's
        order, progress and new tokens; and make its sampling metadata when its rows changed."""
        batch = self.input_batch
        gone = plan.finished_req_ids | plan.preempted_req_ids
        for req_id in gone:
            self.prompt_logprobs.forget(req_id)  # a preempted request computes its prompt anew
        batch.remove_requests(gone)
        for new in plan.scheduled_new_reqs:
            batch.add_request(new)
        cached = plan.scheduled_cached_reqs
        batch.arrange([*cached.req_ids, *(new.req_id for new in plan.scheduled_new_reqs)])
        batch.update_cached(cached)
        if batch.changed:
            batch.refresh_sampling_metadata()

    def prepare_inputs(self, plan: SchedulerOutput) -> StepInputs:
        """Stage the step's inputs on the host and copy them to the device without blocking."""
        batch, buffers = self.input_batch, self.buffers
        num_reqs, num_tokens = batch.num_reqs, plan.total_num_scheduled_tokens
        num_scheduled = np.fromiter(map(plan.num_scheduled_tokens.__getitem__, batch.req_ids[:num_reqs]),
                                    np.int32, num_reqs)
        query_start_loc = buffers.query_start_loc.np[: num_reqs + 1]
        query_start_loc[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        # Token t of the step belongs to request req_of_token[t], at position num_computed + offset.
        req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        num_computed = batch.num_computed_tokens[:num_reqs]
        positions = buffers.positions.np[:num_tokens]
        np.add(num_computed[req_of_token], np.arange(num_tokens) - query_start_loc[req_of_token], out=positions)
        seq_lens = buffers.seq_lens.np[:num_reqs]
        np.add(num_computed, num_scheduled, out=seq_lens)
        max_query_len, max_seq_len = int(num_scheduled.max()), int(seq_lens.max())
        num_cols = buffers.num_cols(max_seq_len)  # only the block-table columns the contexts reach are copied
        block_size = self.settings.block_size
        block_index, block_offset = np.divmod(positions, block_size)
        for table, block_table, slot_mapping in zip(batch.block_tables, buffers.block_tables, buffers.slot_mappings):
            step_table = block_table.np[:num_reqs, :num_cols]
            step_table[:] = table[:num_reqs, :num_cols]
            np.add(step_table[req_of_token, block_index] * block_size, block_offset, out=slot_mapping.np[:num_tokens])
        # A token sampled by the last step and not yet in the plans is garbage here; it is
        # overwritten on the device (_input_ids).
        buffers.input_ids.np[:num_tokens] = batch.token_ids[req_of_token, positions]

        # Every request's last token gives logits; a request whose step ends before the last token
        # it knows (a prompt chunk) drops its sample.
        samples = seq_lens >= batch.num_tokens[:num_reqs]
        logits_indices = None
        if num_tokens > num_reqs:
            np.subtract(query_start_loc[1:], 1, out=self.logits_indices.np[:num_reqs])
            logits_indices = self.logits_indices.copy_to_device(num_reqs)
        prompt_logprobs, prompt_logprob_targets = self.prompt_logprobs.plan(batch, query_start_loc, num_scheduled,
                                                                            num_tokens)
        graph_shape = self.cuda_graphs.shape_for(num_reqs, num_tokens, max_query_len)
        padded_reqs, padded_tokens = num_reqs, num_tokens
        if graph_shape is not None:  # the graph reads the step buffers: their rows up to its shape
            pad_batch(buffers, num_reqs, num_tokens, graph_shape)
            padded_reqs, padded_tokens = graph_shape.num_reqs, graph_shape.num_tokens
            # The metadata the graph was captured with, and the dummy requests' contexts.
            max_query_len = graph_shape.max_query_len
            max_seq_len = int(buffers.seq_lens.np[:padded_reqs].max())
            num_cols = buffers.num_cols(max_seq_len)
        inputs = StepInputs(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            input_ids=self._input_ids(len(plan.scheduled_cached_reqs.req_ids), query_start_loc, padded_tokens),
            positions=buffers.positions.copy_to_device(padded_tokens),
            attn_metadata=buffers.attention_metadata(padded_reqs, padded_tokens, max_query_len, max_seq_len,
                                                     num_cols),
            logits_indices=logits_indices,
            samples=samples,
            sampling_metadata=self._sampling_metadata(plan, seq_lens),
            cuda_graph_shape=graph_shape,
            prompt_logprobs=prompt_logprobs,
            prompt_logprob_targets=prompt_logprob_targets,
        )
        if self.copies_done is not None:
            self.copies_done.record()
        return inputs

    def _input_ids(self, num_cached: int, query_start_loc: np.ndarray, padded_tokens: int) -> torch.Tensor:
        """Copy the staged token ids to the device, then give each cached request whose newest token
        the last step sampled that token, from the device: the host may not know it yet (async
        scheduling). It is the request's one token in this step."""
        input_ids = self.buffers.input_ids.copy_to_device(padded_tokens)
        src = np.fromiter(map(self.prev_req_id_to_index.get, self.input_batch.req_ids[:num_cached],
                              itertools.repeat(-1)), np.int64, num_cached)
        rows = np.flatnonzero(src >= 0)
        n = len(rows)
        if n:
            np.subtract(query_start_loc[1:][rows], 1, out=self.prev_token_dst.np[:n])
            self.prev_token_src.np[:n] = src[rows]
            tokens = self.prev_sampled_token_ids.index_select(0, self.prev_token_src.copy_to_device(n))
            input_ids.index_copy_(0, self.prev_token_dst.copy_to_device(n), tokens)
        return input_ids

    def _sampling_metadata(self, plan: SchedulerOutput, seq_lens: np.ndarray) -> SamplingMetadata:
        """The batch's sampling metadata with what this step adds: the tokens it bans, the grammar
        bitmask, the seeds."""
        batch = self.input_batch
        metadata = batch.step_sampling_metadata(seq_lens, self.prev_sampled_token_ids, self.prev_req_id_to_index)
        if plan.grammar_bitmask is not None:
            # The plan's bitmask rows in the order of the batch's rows, all ones (no constraint) for
            # the rows without a grammar.
            words = plan.grammar_bitmask.shape[1]
            bitmask = self.grammar_bitmask.np[: batch.num_reqs, :words]
            if len(plan.structured_output_request_ids) < batch.num_reqs:
                bitmask.fill(-1)
            plan_bitmask = plan.grammar_bitmask.numpy()
            for req_id, plan_row in plan.structured_output_request_ids.items():
                bitmask[batch.row_of[req_id]] = plan_bitmask[plan_row]
            metadata = replace(metadata, grammar_bitmask=self.grammar_bitmask.copy_to_device(batch.num_reqs, words))
        return self.sampler.add_row_seeds(metadata, batch.row_seeds(seq_lens))

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass: the hidden states of the step's tokens."""
        if inputs.cuda_graph_shape is not None:
            return self.cuda_graphs.replay(inputs.cuda_graph_shape, inputs.num_tokens)
        return self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    def sample(self, hidden_states: torch.Tensor, inputs: StepInputs) -> SamplerOutput:
        """A token for each request, drawn on the device from the logits of its last token, with the
        logprobs the batch asks for."""
        if inputs.logits_indices is not None:  # else every request has one token: no gather
            hidden_states = hidden_states[inputs.logits_indices]
        return self.sampler(self.compute_logits(hidden_states), inputs.sampling_metadata)

    def _launched(self, inputs: StepInputs, sampled: SamplerOutput, prompt_logprobs: dict) -> DeviceStepOutput:
        """Keep the step's tokens on the device for the next step, count them for the penalties,
        and start their way to the host."""
        batch, samples = self.input_batch, inputs.samples
        req_ids = batch.req_ids[: inputs.num_reqs]
        tokens = sampled.sampled_token_ids
        processors = inputs.sampling_metadata.logits_processors
        if processors is not None and processors.penalties is not None:
            batch.count_sampled_tokens(tokens, samples)
        logprobs_rows = None
        if sampled.logprobs_tensors is not None:
            logprobs_rows = np.flatnonzero((batch.num_logprobs[: inputs.num_reqs] >= 0) & samples)
        new = np.flatnonzero(samples).tolist()
        self.prev_sampled_token_ids = tokens
        self.prev_req_id_to_index = {req_ids[row]: row for row in new}
        return DeviceStepOutput(req_ids, samples, sampled, logprobs_rows, prompt_logprobs)

    # -- start-up runs -------------------------------------------------------------------------

    def dummy_inputs(self, query_lens: np.ndarray) -> StepInputs:
        """The inputs of a step of dummy requests with these query lengths, for the start-up runs
        (``dummy_run.py``): every position reads the null block and writes nowhere."""
        settings = self.settings
        num_reqs, num_tokens = len(query_lens), int(query_lens.sum())
        max_query_len = int(query_lens.max())
        # Step buffers of the dummy's own, laid out as the runner's: Triton specialises kernels on the
        # block table's row stride. Their block tables stay all zeros.
        buffers = InputBuffers(self.model.attention_layers(), self.attn_backend,
                               make_kv_cache_groups(self.get_attention_specs()), num_reqs, num_tokens,
                               settings.max_model_len, settings.block_size, self.device, settings.dtype)
        np.cumsum(query_lens, out=buffers.query_start_loc.np[1:])
        buffers.seq_lens.np[:] = query_lens
        buffers.positions.np[:] = np.concatenate([np.arange(n) for n in query_lens])
        for slot_mapping in buffers.slot_mappings:
            slot_mapping.np[:] = -1
        return StepInputs(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            input_ids=buffers.input_ids.copy_to_device(num_tokens),
            positions=buffers.positions.copy_to_device(num_tokens),
            attn_metadata=buffers.attention_metadata(num_reqs, num_tokens, max_query_len, max_query_len, num_cols=1),
            logits_indices=buffers.query_start_loc.device[1:].long() - 1,
            samples=np.ones(num_reqs, bool),
            sampling_metadata=None,
            cuda_graph_shape=None,
            prompt_logprobs=[],
            prompt_logprob_targets=None,
        )
