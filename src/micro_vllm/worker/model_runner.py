"""Runs one step on one device: applies the plan to the persistent batch, stages the step's inputs,
runs the model (through a CUDA graph when one was captured for a shape the step pads to) and samples.

The runner never sees Request objects: it learns everything from the plan's deltas and keeps the
rest itself. ``execute_model`` only launches the step: the sampled tokens come back through the
returned ``AsyncModelRunnerOutput``, so the engine can plan the next step while the GPU works. A
request that decodes right after the step that sampled its token takes that token from the device;
the runner writes a step's tokens into its persistent batch at the first step after the engine
fetched them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import compress

import numpy as np
import torch

from micro_vllm.attention.backends.abstract import AttentionMetadata
from micro_vllm.attention.backends.registry import get_backend_cls
from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.model_loader.checkpoint import load_model
from micro_vllm.outputs import AsyncModelRunnerOutput, LogprobsLists, ModelRunnerOutput
from micro_vllm.sampling.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from micro_vllm.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata, max_top_k
from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer, copy_to_host
from micro_vllm.worker.cuda_graphs import CudaGraphs, CudaGraphShape, cudagraph_capture_shapes, pad_batch
from micro_vllm.worker.dummy_run import warm_up, warm_up_allocators
from micro_vllm.worker.input_batch import InputBatch
from micro_vllm.worker.input_buffers import InputBuffers


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


class DeviceStepOutput(AsyncModelRunnerOutput):
    """The tokens one step samples, on their way to the host (vLLM: AsyncGPUModelRunnerOutput), with
    the logprobs some requests asked for. ``get_output`` waits for them and returns them.

    ``logprobs_rows`` are the sample rows whose request asked for logprobs (their rows of the
    sampler's logprobs); ``prompt_logprobs`` the host copies, chunk by chunk, of the whole prompt of
    each request whose first token the step samples (queued before this step's event)."""

    def __init__(self, req_ids: list[str], sample_rows: np.ndarray, positions: np.ndarray,
                 sampled: SamplerOutput | None, logprobs_rows: np.ndarray | None = None,
                 prompt_logprobs: dict[str, list[LogprobsTensors]] | None = None,
                 batch_rows: np.ndarray | None = None, rows_version: int = -1) -> None:
        self.req_ids = req_ids
        self.sample_rows = sample_rows  # in the step's request order
        self.positions = positions  # where each sampled token goes in its request's token ids
        # The persistent-batch row of each sampled token's request, valid while the batch's
        # rows_version is still ``rows_version``.
        self.batch_rows = batch_rows
        self.rows_version = rows_version
        # On the device; the next step reads it for its decodes.
        self.sampled = None if sampled is None else sampled.sampled_token_ids
        self.fetched = sampled is None
        self.ready: torch.cuda.Event | None = None
        self.host = None if sampled is None else copy_to_host(self.sampled)
        self.logprobs = None
        if sampled is not None and sampled.logprobs_tensors is not None:
            self.logprobs = sampled.logprobs_tensors.to_host()
        self.logprobs_rows = logprobs_rows
        self.prompt_logprobs = prompt_logprobs or {}
        if self.sampled is not None and self.sampled.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def get_output(self) -> ModelRunnerOutput:
        if self.sampled is None:
            return ModelRunnerOutput(self.req_ids, [[] for _ in self.req_ids])
        if self.ready is not None:
            self.ready.synchronize()
        self.fetched = True
        if len(self.host) == len(self.req_ids):  # every request samples (decodes): the rows are in order
            # A column's tolist makes the one-token lists in one call, not a comprehension.
            tokens = self.host.numpy().reshape(-1, 1).tolist()
        else:
            tokens = [[] for _ in self.req_ids]
            for index, token_id in zip(self.sample_rows.tolist(), self.host.tolist()):
                tokens[index] = [token_id]
        logprobs = {}
        if self.logprobs is not None:
            lists = self.logprobs.tolists()
            for row in self.logprobs_rows.tolist():
                req_id = self.req_ids[self.sample_rows[row]]
                logprobs[req_id] = LogprobsLists([lists.logprob_token_ids[row]], [lists.logprobs[row]],
                                                 [lists.ranks[row]])
        prompt_logprobs = {req_id: LogprobsTensors.cat(chunks).tolists()
                           for req_id, chunks in self.prompt_logprobs.items()}
        return ModelRunnerOutput(self.req_ids, tokens, logprobs, prompt_logprobs)


@dataclass(frozen=True)
class PromptLogprobsSlice:
    """The tokens of one request in a step whose next token is a prompt token, for its prompt logprobs."""

    req_id: str
    tokens: slice  # in the step's tokens (maybe none); the tokens they predict are at the same indices of the targets
    num_logprobs: int
    # The step computes the prompt's last token (and samples): the prompt's logprobs go out with that token.
    completes: bool


@dataclass(frozen=True)
class SamplingSettings:
    """What the sampling rows of a step ask for, as staged on the device. A row's settings never
    change, so a later step that samples the same rows while no row has changed hands reuses them
    (most decode steps)."""

    rows_version: int  # the batch's rows_version then
    rows: np.ndarray  # the batch rows that sample, in the step's order
    metadata: SamplingMetadata  # without the fields of one step (seeds, logits processors' inputs)
    uses_processors: bool  # a row uses a logits processor
    seeded_rows: np.ndarray  # the positions in ``rows`` of those with a seed of their own


@dataclass(frozen=True)
class StepRows:
    """The batch rows of one step's requests, valid while the batch's rows_version is unchanged."""

    rows_version: int
    req_ids: tuple[str, ...]
    rows: np.ndarray  # read-only: later steps share it

    def __post_init__(self) -> None:
        self.rows.flags.writeable = False


@dataclass
class StepInputs:
    batch_rows: np.ndarray  # the persistent-batch row of each request, in the step's order
    num_reqs: int
    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]  # one per decoder layer
    # The last token of each request that samples this step; None when every token samples (decodes).
    logits_indices: torch.Tensor | None
    sample_rows: np.ndarray  # positions in the step's request order of those requests
    sampling_metadata: SamplingMetadata
    cuda_graph_shape: CudaGraphShape | None  # the captured shape the step is padded to and replays; None: eager
    prompt_logprobs: list[PromptLogprobsSlice]  # empty unless a request of the step asks for prompt logprobs
    prompt_logprob_targets: torch.Tensor | None  # per step token, the prompt token it predicts (in the slices)
    grammar_bitmask: torch.Tensor | None  # one row per sampling request (structured output); None: none


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
        # Per request, its prompt logprobs computed so far (host copies by chunk), until its last chunk.
        self.in_progress_prompt_logprobs: dict[str, list[LogprobsTensors]] = {}
        self.input_batch: InputBatch | None = None
        self.cuda_graphs = CudaGraphs()
        # Marks when the last step's host-to-device copies finished: the host must not refill the
        # staged buffers before then (nothing else waits for the GPU between steps). Every copy of a
        # step is queued before its forward pass, so the wait never covers GPU compute.
        self.copies_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self.last_output: DeviceStepOutput | None = None  # the step launched last
        self.sampling_settings: SamplingSettings | None = None  # those of the rows the last step sampled
        self.step_rows: StepRows | None = None  # the rows of the last step's requests
        self.rows_without_prompt_logprobs: np.ndarray | None = None  # read-only step rows none of which asks
        self.unapplied: list[DeviceStepOutput] = []  # launched steps whose tokens token_ids lacks

    # -- set-up --------------------------------------------------------------------------------

    def get_attention_specs(self) -> list[AttentionSpec]:
        return [layer.spec for layer in self.model.attention_layers()]

    def kv_cache_bytes_per_block(self) -> int:
        element = self.settings.kv_cache_dtype.itemsize
        return sum(
            2 * self.settings.block_size * spec.num_kv_heads * spec.head_size * element
            for spec in self.get_attention_specs()
        )

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        """Allocate each layer's paged K/V tensor, the persistent batch and the step buffers; then
        (on CUDA) warm up, capture CUDA graphs and warm up the allocators for serving."""
        settings = self.settings
        layers = self.model.attention_layers()
        for layer in layers:
            layer.kv_cache = torch.empty(
                2, num_blocks, settings.block_size, layer.num_kv_heads, layer.head_size,
                dtype=settings.kv_cache_dtype, device=self.device,
            )
            # Every slot is written before it is read, except the null block that stands in for
            # positions outside a sliding window (and pads CUDA-graph batches): masked, but multiplied
            # by zero, so it must hold no NaN.
            layer.kv_cache[:, 0].zero_()
        max_blocks = -(-settings.max_model_len // settings.block_size)
        max_reqs, max_tokens = settings.max_num_seqs, max(settings.max_num_batched_tokens, settings.max_num_seqs)
        self.input_batch = InputBatch(max_reqs, settings.max_model_len, [max_blocks] * len(groups), self.vocab_size,
                                      self.device)
        # One request slot more than can run, for the dummy prompt that pads a step to a CUDA graph.
        self.buffers = InputBuffers(layers, self.attn_backend, groups, max_reqs + 1, max_tokens,
                                    settings.max_model_len, settings.block_size, self.device)
        staged = lambda *shape, dtype=torch.int32: CpuGpuBuffer(shape, dtype, self.device)  # noqa: E731
        self.logits_indices = staged(max_reqs, dtype=torch.int64)
        self.temperature = staged(max_reqs, dtype=torch.float32)
        self.top_k = staged(max_reqs)
        self.top_p = staged(max_reqs, dtype=torch.float32)
        self.min_p = staged(max_reqs, dtype=torch.float32)
        self.prev_token_dst = staged(max_reqs, dtype=torch.int64)  # step tokens that take ...
        self.prev_token_src = staged(max_reqs, dtype=torch.int64)  # ... the last step's sampled tokens
        self.prompt_logprob_targets = staged(max_tokens, dtype=torch.int64)
        # Read-only constants: the index ranges and the one-token counts of decode steps.
        self.arange = np.arange(max_tokens + 1)
        self.ones = np.ones(max_reqs, np.int32)
        self.arange.flags.writeable = self.ones.flags.writeable = False
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
        self.in_progress_prompt_logprobs.clear()
        self.last_output = None
        self.unapplied.clear()

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> DeviceStepOutput:
        """Launch the plan's step; its tokens arrive through the returned handle."""
        self.apply_fetched_outputs()
        rows = self.update_states(plan)
        req_ids = list(plan.num_scheduled_tokens)
        if plan.is_empty:
            return DeviceStepOutput(req_ids, np.empty(0, np.int64), np.empty(0, np.int64), None)
        inputs = self.prepare_inputs(plan, req_ids, rows)
        hidden_states = self.run_model(inputs)
        sampled = self.sample(hidden_states, inputs)
        prompt_logprobs = self.compute_prompt_logprobs(hidden_states, inputs) if inputs.prompt_logprobs else None
        batch = self.input_batch
        processors = inputs.sampling_metadata.logits_processors
        if processors is not None and processors.penalties is not None:  # count the new tokens on the device
            penalties = processors.penalties
            batch.token_counts.count(penalties.batch_rows, sampled.sampled_token_ids[penalties.rows])
        # Every request samples (decodes): its rows are the step's, the same array as the last step's
        # while it ran the same requests in the same rows.
        sample_rows = inputs.batch_rows if len(inputs.sample_rows) == inputs.num_reqs else \
            inputs.batch_rows[inputs.sample_rows]
        logprobs_rows = None
        if sampled.logprobs_tensors is not None:
            logprobs_rows = np.flatnonzero(batch.num_logprobs[sample_rows] >= 0)
        # The new tokens count from now on; their ids reach token_ids once the engine fetched them.
        positions = batch.num_tokens[sample_rows].astype(np.int64)
        batch.num_tokens[sample_rows] = positions + 1
        if not self._last_step_sampled(sample_rows):  # else each row keeps its index
            batch.last_sample_index.fill(-1)
            batch.last_sample_index[sample_rows] = np.arange(len(sample_rows))
        self.last_output = DeviceStepOutput(req_ids, inputs.sample_rows, positions, sampled, logprobs_rows,
                                            prompt_logprobs, sample_rows, batch.rows_version)
        self.unapplied.append(self.last_output)
        return self.last_output

    def _last_step_sampled(self, rows: np.ndarray) -> bool:
        """Whether the last step sampled exactly the batch rows ``rows``, in this order (the same
        read-only array of a ``StepRows``), and no row has changed hands since: then each row's
        ``last_sample_index`` is its position in ``rows``."""
        last = self.last_output
        return last is not None and last.batch_rows is rows and last.rows_version == self.input_batch.rows_version

    def apply_fetched_outputs(self) -> None:
        """Write the tokens of the steps whose output the engine has fetched since into the
        persistent batch: into the rows the step ran in while no row has changed hands since, else
        by request id (rows may have moved, and a request that finished or was preempted meanwhile
        is gone)."""
        batch = self.input_batch
        for output in [o for o in self.unapplied if o.fetched]:
            self.unapplied.remove(output)
            tokens = output.host.numpy()
            if output.rows_version == batch.rows_version:
                batch.token_ids[output.batch_rows, output.positions] = tokens
                continue
            req_ids, row_of = output.req_ids, batch.row_of
            rows = np.array([row_of.get(req_ids[i], -1) for i in output.sample_rows.tolist()], np.int64)
            present = rows >= 0
            batch.token_ids[rows[present], output.positions[present]] = tokens[present]

    def update_states(self, plan: SchedulerOutput) -> np.ndarray:
        """Apply the plan's deltas to the persistent batch: requests that left, new ones, progress.
        Returns the batch row of each request of the step, in the step's order (the requests the
        batch held, then the new ones)."""
        batch = self.input_batch
        for req_id in plan.finished_req_ids | plan.preempted_req_ids:
            if req_id in batch.row_of:
                batch.remove_request(req_id)
            self.in_progress_prompt_logprobs.pop(req_id, None)  # a preempted request computes its prompt anew
        first_new_row = len(batch)
        for new in plan.scheduled_new_reqs:
            batch.add_request(new)
        cached = plan.scheduled_cached_reqs
        rows = self._rows_of(cached.req_ids)
        if cached.req_ids:
            batch.num_computed_tokens[rows] = np.fromiter(cached.num_computed_tokens, np.int32, len(rows))
            new_block_ids = cached.new_block_ids
            # A request's BlockIds holds a tuple per group, so it is never empty: only None is false.
            with_blocks = list(compress(range(len(new_block_ids)), new_block_ids))
            if with_blocks:  # most decodes get no new block
                batch.append_block_ids(rows[with_blocks], [new_block_ids[i] for i in with_blocks])
        if plan.scheduled_new_reqs:
            rows = np.concatenate([rows, np.arange(first_new_row, len(batch))])
            new_ids = tuple(new.req_id for new in plan.scheduled_new_reqs)
            self.step_rows = StepRows(batch.rows_version, cached.req_ids + new_ids, rows)
        return rows

    def _rows_of(self, req_ids: tuple[str, ...]) -> np.ndarray:
        """The batch rows of ``req_ids``. Most steps run the last step's requests in the same order
        while no row has changed hands, and reuse its rows instead of looking each request up."""
        batch, last = self.input_batch, self.step_rows
        if last is not None and last.rows_version == batch.rows_version and last.req_ids == req_ids:
            return last.rows
        row_of = batch.row_of
        rows = np.array([row_of[req_id] for req_id in req_ids], np.int64)
        self.step_rows = StepRows(batch.rows_version, req_ids, rows)
        return rows

    def prepare_inputs(self, plan: SchedulerOutput, req_ids: list[str], rows: np.ndarray) -> StepInputs:
        """Stage the step's inputs on the host and copy them to the device without blocking;
        ``rows``: the batch row of each of ``req_ids``."""
        if self.copies_done is not None:
            self.copies_done.synchronize()
        batch, buffers = self.input_batch, self.buffers
        num_reqs, num_tokens = len(req_ids), plan.total_num_scheduled_tokens
        query_start_loc = buffers.query_start_loc.np[: num_reqs + 1]
        num_computed = batch.num_computed_tokens[rows]
        positions = buffers.positions.np[:num_tokens]
        if num_tokens == num_reqs:  # one token each (decodes): token i is request i's, at its next position
            num_scheduled = self.ones[:num_reqs]
            query_start_loc[:] = self.arange[: num_reqs + 1]
            req_of_token = self.arange[:num_reqs]
            positions[:] = num_computed
            max_query_len = 1
        else:
            num_scheduled = np.fromiter(plan.num_scheduled_tokens.values(), np.int32, num_reqs)
            query_start_loc[0] = 0
            np.cumsum(num_scheduled, out=query_start_loc[1:])
            # Token t of the step belongs to request req_of_token[t], at position num_computed + offset.
            req_of_token = np.repeat(self.arange[:num_reqs], num_scheduled)
            offsets = self.arange[:num_tokens] - np.repeat(query_start_loc[:-1], num_scheduled)
            np.add(num_computed[req_of_token], offsets, out=positions)
            max_query_len = int(num_scheduled.max())
        seq_lens = buffers.seq_lens.np[:num_reqs]
        np.add(num_computed, num_scheduled, out=seq_lens)

        block_size = self.settings.block_size
        block_index, block_offset = np.divmod(positions, block_size)
        # Only the columns this step's contexts reach are gathered and copied; the rest is never read.
        max_seq_len = int(seq_lens.max())
        num_cols = buffers.num_cols(max_seq_len)
        for table, block_table, slot_mapping in zip(batch.block_tables, buffers.block_tables, buffers.slot_mappings):
            step_table = block_table.np[:num_reqs, :num_cols]
            step_table[:] = table[rows, :num_cols]
            np.add(step_table[req_of_token, block_index] * block_size, block_offset, out=slot_mapping.np[:num_tokens])

        # Only requests whose every token so far (sampled ones still on the device too) is now
        # computed produce a next token.
        sample_rows = np.nonzero(seq_lens == batch.num_tokens[rows])[0]
        num_samples = len(sample_rows)
        logits_indices = None
        if num_samples < num_tokens:
            np.subtract(query_start_loc[1:][sample_rows], 1, out=self.logits_indices.np[:num_samples])
            logits_indices = self.logits_indices.copy_to_device(num_samples)
        prompt_logprobs = []
        if self._asks_prompt_logprobs(rows):
            prompt_logprobs = self._plan_prompt_logprobs(req_ids, rows, query_start_loc, num_computed, num_scheduled)
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
            batch_rows=rows,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            input_ids=self._input_ids(rows, req_of_token, positions, query_start_loc, num_tokens, padded_tokens),
            positions=buffers.positions.copy_to_device(padded_tokens),
            attn_metadata=buffers.attention_metadata(padded_reqs, padded_tokens, max_query_len, max_seq_len,
                                                     num_cols),
            logits_indices=logits_indices,
            sample_rows=sample_rows,
            sampling_metadata=self._sampling_metadata(rows if num_samples == num_reqs else rows[sample_rows]),
            cuda_graph_shape=graph_shape,
            prompt_logprobs=prompt_logprobs,
            prompt_logprob_targets=self.prompt_logprob_targets.copy_to_device(num_tokens) if prompt_logprobs else None,
            grammar_bitmask=self._grammar_bitmask(plan, req_ids, sample_rows),
        )
        if self.copies_done is not None:
            self.copies_done.record()
        return inputs

    def _asks_prompt_logprobs(self, rows: np.ndarray) -> bool:
        """Whether a request at the batch ``rows`` still asks for prompt logprobs. A row stops asking
        when its prompt is done and asks only from when a request takes it, which changes a step's
        rows: read-only rows (a ``StepRows``', the same while its requests hold them) in which none
        asked ask for none while they last."""
        if rows is self.rows_without_prompt_logprobs:
            return False
        if (self.input_batch.num_prompt_logprobs[rows] >= 0).any():
            return True
        if not rows.flags.writeable:
            self.rows_without_prompt_logprobs = rows
        return False

    def _plan_prompt_logprobs(self, req_ids: list[str], rows: np.ndarray, query_start_loc: np.ndarray,
                              num_computed: np.ndarray, num_scheduled: np.ndarray) -> list[PromptLogprobsSlice]:
        """For each request of the step that asks for prompt logprobs, its tokens whose next token is
        a prompt token (the last of a chunk predicts the first of the next); their targets staged.

        The prompt's logprobs go out with its first sampled token: a request preempted before that
        computes its prompt anew, and one preempted after it resumes with that token, so it needs
        none (``InputBatch.add_request``); a row whose prompt is done asks for none any more."""
        batch = self.input_batch
        targets = self.prompt_logprob_targets.np
        slices = []
        for i in np.flatnonzero(batch.num_prompt_logprobs[rows] >= 0).tolist():
            row = rows[i]
            num_prompt_tokens = int(batch.num_prompt_tokens[row])
            start, stop = int(num_computed[i]), int(num_computed[i] + num_scheduled[i])
            end = min(stop, num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
            first = int(query_start_loc[i])
            tokens = slice(first, first + end - start)
            targets[tokens] = batch.token_ids[row, start + 1 : end + 1]
            completes = stop == num_prompt_tokens
            slices.append(PromptLogprobsSlice(req_ids[i], tokens, int(batch.num_prompt_logprobs[row]), completes))
            if completes:
                batch.num_prompt_logprobs[row] = -1
        return slices

    def _input_ids(self, rows: np.ndarray, req_of_token: np.ndarray, positions: np.ndarray,
                   query_start_loc: np.ndarray, num_tokens: int, padded_tokens: int) -> torch.Tensor:
        """Stage the step's token ids and copy them to the device, then put in the tokens the last
        step sampled and the host has not seen (async scheduling): each is the last token of its
        request here. When that is every token of the step, in the order the last step sampled them
        (most decode steps), the device copies them over and the host stages nothing."""
        buffers, batch = self.buffers, self.input_batch
        last = self.last_output
        unseen = last is not None and last in self.unapplied  # the host has not seen its tokens
        if (unseen and num_tokens == len(rows) == padded_tokens
                and (self._last_step_sampled(rows)
                     or np.array_equal(batch.last_sample_index[rows], self.arange[:num_tokens]))):
            input_ids = buffers.input_ids.device_rows(num_tokens)
            sampled = last.sampled
            input_ids.copy_(sampled if len(sampled) == num_tokens else sampled[:num_tokens])
            return input_ids
        src = batch.last_sample_index[rows] if unseen else None
        # Tokens sampled by a step whose output the host has not read yet are garbage here; they are
        # overwritten on the device from that step's sampled tensor below.
        buffers.input_ids.np[:num_tokens] = batch.token_ids[rows[req_of_token], positions]
        input_ids = buffers.input_ids.copy_to_device(padded_tokens)
        if src is None:
            return input_ids
        mask = src >= 0
        n = int(mask.sum())
        if n:
            dst = self.prev_token_dst.np[:n]
            np.subtract(query_start_loc[1:][mask], 1, out=dst)
            self.prev_token_src.np[:n] = src[mask]
            input_ids[self.prev_token_dst.copy_to_device(n)] = last.sampled[self.prev_token_src.copy_to_device(n)]
        return input_ids

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampling inputs of the persistent-batch ``rows`` that sample this step: the rows'
        settings, and what changes from step to step (logits processors' inputs, seeds)."""
        batch = self.input_batch
        settings = self._sampling_settings(rows)
        metadata = replace(settings.metadata)  # the step's own fields are set on this copy
        if settings.uses_processors:
            last = self.last_output
            last_sampled = last.sampled if last is not None and last in self.unapplied else None
            metadata.logits_processors = batch.logits_processors_metadata(rows, last_sampled)
        # A seeded row's randomness depends only on (seed, output position): it survives preemption
        # and does not depend on what else is in the batch.
        row_seeds = {}
        seeded = settings.seeded_rows
        if len(seeded):
            positions = batch.num_tokens[rows[seeded]] - batch.num_prompt_tokens[rows[seeded]]  # this token's
            row_seeds = {int(i): hash((int(batch.seed[rows[i]]), int(p))) & (2**63 - 1)
                         for i, p in zip(seeded, positions)}
        self.sampler.add_row_seeds(metadata, row_seeds)
        return metadata

    def _sampling_settings(self, rows: np.ndarray) -> SamplingSettings:
        """The settings of ``rows``, staged and copied to the device; those of the last step when it
        sampled the same rows and no row has changed hands since (at once when ``rows`` is the same
        read-only array, a ``StepRows``' of a step in which every request samples)."""
        batch = self.input_batch
        last = self.sampling_settings
        if last is not None and last.rows_version == batch.rows_version and (
                last.rows is rows or np.array_equal(last.rows, rows)):
            return last
        n = len(rows)
        temperature = np.take(batch.temperature, rows, out=self.temperature.np[:n])
        top_k = np.take(batch.top_k, rows, out=self.top_k.np[:n])
        top_p = np.take(batch.top_p, rows, out=self.top_p.np[:n])
        num_logprobs = int(batch.num_logprobs[rows].max(initial=-1))
        metadata = SamplingMetadata(
            temperature=self.temperature.copy_to_device(n),
            top_k=self.top_k.copy_to_device(n) if top_k.any() else None,
            top_p=self.top_p.copy_to_device(n) if (top_p < 1).any() else None,
            all_greedy=bool((temperature == 0).all()),
            all_random=bool((temperature > 0).all()),
            max_num_logprobs=num_logprobs if num_logprobs >= 0 else None,
            max_top_k=max_top_k(top_k, top_p),
        )
        if (np.take(batch.min_p, rows, out=self.min_p.np[:n]) > 0).any():
            metadata.min_p = self.min_p.copy_to_device(n)
        kept_rows = rows if not rows.flags.writeable else rows.copy()  # a StepRows' array is never written
        self.sampling_settings = SamplingSettings(batch.rows_version, kept_rows, metadata,
                                                  bool(batch.uses_processors[rows].any()),
                                                  np.flatnonzero(batch.seed[rows] >= 0))
        return self.sampling_settings

    @staticmethod
    def _grammar_bitmask(plan: SchedulerOutput, req_ids: list[str], sample_rows: np.ndarray) -> torch.Tensor | None:
        """The plan's bitmask rows in the order of the step's logits, all ones (no constraint) for the
        requests without a grammar; None when no request samples under one."""
        if plan.grammar_bitmask is None:
            return None
        bitmask = torch.full((len(sample_rows), plan.grammar_bitmask.shape[1]), -1, dtype=torch.int32)
        logits_row = {req_ids[step_index]: row for row, step_index in enumerate(sample_rows.tolist())}
        for req_id, plan_row in plan.structured_output_request_ids.items():
            bitmask[logits_row[req_id]] = plan.grammar_bitmask[plan_row]
        return bitmask

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass: the hidden states of the step's tokens."""
        if inputs.cuda_graph_shape is not None:
            return self.cuda_graphs.replay(inputs.cuda_graph_shape, inputs.num_tokens)
        return self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)

    def sample(self, hidden_states: torch.Tensor, inputs: StepInputs) -> SamplerOutput:
        """The logits of the requests that sample this step, and a token drawn for each (on the device),
        with the logprobs the batch asks for."""
        if inputs.logits_indices is not None:  # else every token samples (decodes): no gather
            hidden_states = hidden_states[inputs.logits_indices]
        logits = self.model.compute_logits(hidden_states)
        if inputs.grammar_bitmask is not None:
            # Loaded here: only structured-output requests need xgrammar.
            from micro_vllm.structured_output.manager import apply_grammar_bitmask

            apply_grammar_bitmask(logits, inputs.grammar_bitmask)
        return self.sampler(logits, inputs.sampling_metadata)

    def compute_prompt_logprobs(self, hidden_states: torch.Tensor,
                                inputs: StepInputs) -> dict[str, list[LogprobsTensors]]:
        """The raw logprobs of the prompt tokens this step's tokens predict, per request that asks,
        copied to the host without blocking; returns the whole prompt's of each request whose prompt
        they complete. A request's logits are computed at all its slice's tokens at once."""
        completed = {}
        for part in inputs.prompt_logprobs:
            chunks = self.in_progress_prompt_logprobs.setdefault(part.req_id, [])
            if part.tokens.stop > part.tokens.start:
                logits = self.model.compute_logits(hidden_states[part.tokens])
                tensors = gather_logprobs(compute_logprobs(logits), part.num_logprobs,
                                          inputs.prompt_logprob_targets[part.tokens])
                chunks.append(tensors.to_host())
            if part.completes:
                completed[part.req_id] = self.in_progress_prompt_logprobs.pop(part.req_id)
        return completed
