"""Executes plans on one device: keeps the persistent batch and the physical KV tensors, builds each
step's input tensors, runs the model (through a CUDA graph when the step is all decodes) and samples.

The runner never sees Request objects: it learns everything from the plan's deltas and keeps the
rest itself. ``execute_model`` only launches the step: the sampled tokens come back through the
returned ``AsyncModelRunnerOutput``, so the engine can plan the next step while the GPU works. A
request that decodes right after the step that sampled its token takes that token from the device.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch

from micro_vllm.attention.attention import AttentionMetadata
from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.model_loader.checkpoint import load_model
from micro_vllm.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from micro_vllm.sampling.sampler import Sampler, SamplingMetadata
from micro_vllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

MAX_CUDA_GRAPH_BATCH = 512  # larger decode batches run eagerly


@dataclass(frozen=True)
class RunnerSettings:
    """What the runner needs to know, resolved by the Worker."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    custom_ops: frozenset[str]  # the ops that run their Triton kernel (resolve_custom_ops)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    seed: int
    use_cuda_graphs: bool


class StagedBuffer:
    """A host buffer and its device twin, allocated once. Steps fill the host side with numpy and
    copy the used prefix over without blocking; on CPU both sides are the same tensor. Before the
    host side is refilled, the runner waits for the previous step's copies (``copies_done``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def copy_to_device(self, n: int, cols: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (of a 2-D buffer, only their first ``cols`` columns) and return
        the device rows."""
        if self.device is not self.cpu:
            index = (slice(n),) if cols is None else (slice(n), slice(cols))
            self.device[index].copy_(self.cpu[index], non_blocking=True)
        return self.device[:n]


class DeviceStepOutput(AsyncModelRunnerOutput):
    """The tokens one step samples, on their way to the host (vLLM: AsyncGPUModelRunnerOutput).
    ``get_output`` waits for them and writes them into the persistent batch (by request id: rows may
    have moved since)."""

    def __init__(self, req_ids: list[str], sample_rows: np.ndarray, positions: np.ndarray,
                 sampled: torch.Tensor | None, input_batch: InputBatch) -> None:
        self.req_ids = req_ids
        self.sample_rows = sample_rows  # in the step's request order
        self.positions = positions  # where each sampled token goes in its request's token ids
        self.sampled = sampled  # on the device; the next step reads it for its decodes
        self.input_batch = input_batch
        self.fetched = sampled is None
        self.ready: torch.cuda.Event | None = None
        self.host = sampled
        if sampled is not None and sampled.is_cuda:
            self.host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self.host.copy_(sampled, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def get_output(self) -> ModelRunnerOutput:
        tokens: list[list[int]] = [[] for _ in self.req_ids]
        if self.sampled is None:
            return ModelRunnerOutput(self.req_ids, tokens)
        if self.ready is not None:
            self.ready.synchronize()
        self.fetched = True
        batch = self.input_batch
        for index, position, token_id in zip(self.sample_rows.tolist(), self.positions.tolist(), self.host.tolist()):
            tokens[index] = [token_id]
            row = batch.row_of.get(self.req_ids[index])
            if row is not None:  # gone if it finished or was preempted meanwhile
                batch.token_ids[row, position] = token_id
        return ModelRunnerOutput(self.req_ids, tokens)


@dataclass
class StepInputs:
    batch_rows: np.ndarray  # the persistent-batch row of each request, in the step's order
    num_reqs: int
    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]  # one per decoder layer
    logits_indices: torch.Tensor  # the last token of each request that samples this step
    sample_rows: np.ndarray  # positions in the step's request order of those requests
    sampling_metadata: SamplingMetadata


class ModelRunner:
    def __init__(self, settings: RunnerSettings, model_path, hf_config) -> None:
        self.settings = settings
        self.device = settings.device
        # Building the modules draws their initial weights (overwritten by the checkpoint) from
        # torch's global RNG: the caller's RNG state must not change.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.model = load_model(model_path, hf_config, settings.dtype, settings.device,
                                    settings.attention_backend, settings.custom_ops)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(settings.seed))
        self.seed_stream = np.random.default_rng(settings.seed)  # per-row seeds of the Triton sampler
        self.layer_group: list[int] = []  # decoder layer -> its KV cache group
        self.input_batch: InputBatch | None = None
        self.cuda_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> graph, output
        # Marks when the last step's host-to-device copies finished: the host must not refill the
        # staged buffers before then (nothing else waits for the GPU between steps). Every copy of a
        # step is queued before its forward pass, so the wait never covers GPU compute.
        self.copies_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self.last_output: DeviceStepOutput | None = None  # the step launched last

    # -- set-up --------------------------------------------------------------------------------

    def get_attention_specs(self) -> list[AttentionSpec]:
        return [layer.spec for layer in self.model.attention_layers()]

    def kv_cache_bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.settings.dtype).element_size()
        return sum(
            2 * self.settings.block_size * spec.num_kv_heads * spec.head_size * element
            for spec in self.get_attention_specs()
        )

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        """Allocate each layer's paged K/V tensor, the persistent batch and the step buffers; then
        (on CUDA) warm up and capture CUDA graphs."""
        settings = self.settings
        self.layer_group = [0] * len(self.model.attention_layers())
        for group_id, group in enumerate(groups):
            for layer_index in group.layer_indices:
                self.layer_group[layer_index] = group_id
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(
                2, num_blocks, settings.block_size, layer.num_kv_heads, layer.head_size,
                dtype=settings.dtype, device=self.device,
            )
            # Every slot is written before it is read, except the null block that stands in for
            # positions outside a sliding window (and pads CUDA-graph batches): masked, but multiplied
            # by zero, so it must hold no NaN.
            layer.kv_cache[:, 0].zero_()
        max_blocks = -(-settings.max_model_len // settings.block_size)
        max_reqs, max_tokens = settings.max_num_seqs, max(settings.max_num_batched_tokens, settings.max_num_seqs)
        self.input_batch = InputBatch(max_reqs, settings.max_model_len, [max_blocks] * len(groups))
        staged = lambda *shape, dtype=torch.int32: StagedBuffer(shape, dtype, self.device)  # noqa: E731
        self.input_ids = staged(max_tokens, dtype=torch.int64)
        self.positions = staged(max_tokens, dtype=torch.int64)
        self.query_start_loc = staged(max_reqs + 1)
        self.seq_lens = staged(max_reqs)
        self.decode_order = staged(max_reqs)  # decode steps: requests by context length, longest first
        self.logits_indices = staged(max_reqs, dtype=torch.int64)
        self.block_tables = [staged(max_reqs, max_blocks) for _ in groups]
        self.slot_mappings = [staged(max_tokens, dtype=torch.int64) for _ in groups]
        self.temperature = staged(max_reqs, dtype=torch.float32)
        self.top_k = staged(max_reqs)
        self.top_p = staged(max_reqs, dtype=torch.float32)
        self.seeds = staged(max_reqs, dtype=torch.int64)
        self.prev_token_dst = staged(max_reqs, dtype=torch.int64)  # step tokens that take ...
        self.prev_token_src = staged(max_reqs, dtype=torch.int64)  # ... the last step's sampled tokens
        self.arange = torch.arange(max_reqs + 1, dtype=torch.int32, device=self.device)
        if self.device.type == "cuda":
            self.warm_up()
        if settings.use_cuda_graphs:
            self.capture_cuda_graphs()

    # -- one step ------------------------------------------------------------------------------

    def reset_batch(self) -> None:
        """Forget every request after a failed step: the persistent batch empties, and the tokens
        of the last step launched (which the scheduler will never see) are not read by the next."""
        self.input_batch.clear()
        self.last_output = None

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> DeviceStepOutput:
        """Launch the plan's step; its tokens arrive through the returned handle."""
        self._update_states(plan)
        req_ids = list(plan.num_scheduled_tokens)
        if plan.is_empty:
            return DeviceStepOutput(req_ids, np.empty(0, np.int64), np.empty(0, np.int64), None, self.input_batch)
        inputs = self._prepare_inputs(plan, req_ids)
        hidden_states = self._run_model(inputs)
        if len(inputs.sample_rows) < inputs.num_tokens:  # else every token samples (decodes): no gather
            hidden_states = hidden_states[inputs.logits_indices]
        logits = self.model.compute_logits(hidden_states)
        batch = self.input_batch
        sample_rows = inputs.batch_rows[inputs.sample_rows]
        sampled = self.sampler(logits, inputs.sampling_metadata)
        # The new tokens count from now on; their ids reach the host (and token_ids) in get_output.
        positions = batch.num_tokens[sample_rows].astype(np.int64)
        batch.num_tokens[sample_rows] += 1
        batch.last_sample_index.fill(-1)
        batch.last_sample_index[sample_rows] = np.arange(len(sample_rows))
        self.last_output = DeviceStepOutput(req_ids, inputs.sample_rows, positions, sampled, batch)
        return self.last_output

    def _update_states(self, plan: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in plan.finished_req_ids | plan.preempted_req_ids:
            if req_id in batch.row_of:
                batch.remove_request(req_id)
        for new in plan.scheduled_new_reqs:
            batch.add_request(new)
        cached_reqs = plan.scheduled_cached_reqs
        if cached_reqs:
            rows = [batch.row_of[cached.req_id] for cached in cached_reqs]
            batch.num_computed_tokens[rows] = [cached.num_computed_tokens for cached in cached_reqs]
            for row, cached in zip(rows, cached_reqs):
                if any(cached.new_block_ids):  # most decodes get no new block
                    batch.append_block_ids(row, cached.new_block_ids)

    def _prepare_inputs(self, plan: SchedulerOutput, req_ids: list[str]) -> StepInputs:
        if self.copies_done is not None:
            self.copies_done.synchronize()
        batch = self.input_batch
        num_reqs = len(req_ids)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int64, num_reqs)
        num_scheduled = np.fromiter(plan.num_scheduled_tokens.values(), np.int32, num_reqs)
        query_start_loc = self.query_start_loc.np[: num_reqs + 1]
        query_start_loc[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # Token t of the step belongs to request req_of_token[t], at position num_computed + offset.
        req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], num_scheduled)
        num_computed = batch.num_computed_tokens[rows]
        positions = self.positions.np[:num_tokens]
        np.add(num_computed[req_of_token], offsets, out=positions)
        # Tokens sampled by a step whose output the host has not read yet are garbage here; they are
        # overwritten on the device from that step's sampled tensor below.
        self.input_ids.np[:num_tokens] = batch.token_ids[rows[req_of_token], positions]
        seq_lens = self.seq_lens.np[:num_reqs]
        np.add(num_computed, num_scheduled, out=seq_lens)

        block_size = self.settings.block_size
        block_index, block_offset = np.divmod(positions, block_size)
        # Only the columns this step's contexts reach are gathered and copied; the rest is never read.
        num_cols = -(-int(seq_lens.max()) // block_size)
        for table, block_table, slot_mapping in zip(batch.block_tables, self.block_tables, self.slot_mappings):
            step_table = block_table.np[:num_reqs, :num_cols]
            step_table[:] = table[rows, :num_cols]
            np.add(step_table[req_of_token, block_index] * block_size, block_offset, out=slot_mapping.np[:num_tokens])

        # Only requests whose every token so far (sampled ones still on the device too) is now
        # computed produce a next token.
        sample_rows = np.nonzero(seq_lens == batch.num_tokens[rows])[0]
        num_samples = len(sample_rows)
        np.subtract(query_start_loc[1:][sample_rows], 1, out=self.logits_indices.np[:num_samples])
        inputs = StepInputs(
            batch_rows=rows,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            input_ids=self._input_ids(rows, query_start_loc, num_tokens),
            positions=self.positions.copy_to_device(num_tokens),
            attn_metadata=self._attention_metadata(
                num_reqs, num_tokens, int(num_scheduled.max()), int(seq_lens.max()), num_cols
            ),
            logits_indices=self.logits_indices.copy_to_device(num_samples),
            sample_rows=sample_rows,
            sampling_metadata=self._sampling_metadata(rows[sample_rows]),
        )
        if self.copies_done is not None:
            self.copies_done.record()
        return inputs

    def _input_ids(self, rows: np.ndarray, query_start_loc: np.ndarray, num_tokens: int) -> torch.Tensor:
        """Copy the step's token ids to the device, then put in the tokens the last step sampled
        and the host has not seen (async scheduling): each is the last token of its request here."""
        input_ids = self.input_ids.copy_to_device(num_tokens)
        last = self.last_output
        if last is None or last.fetched:
            return input_ids
        src = self.input_batch.last_sample_index[rows]
        mask = src >= 0
        n = int(mask.sum())
        if n:
            dst = self.prev_token_dst.np[:n]
            np.subtract(query_start_loc[1:][mask], 1, out=dst)
            self.prev_token_src.np[:n] = src[mask]
            input_ids[self.prev_token_dst.copy_to_device(n)] = last.sampled[self.prev_token_src.copy_to_device(n)]
        return input_ids

    def _attention_metadata(
        self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int, num_cols: int
    ) -> list[AttentionMetadata]:
        """Copy the staged step inputs to the device and wrap them per KV cache group; a decode step
        (one token per request) also gets its requests ordered longest context first."""
        query_start_loc = self.query_start_loc.copy_to_device(num_reqs + 1)
        seq_lens = self.seq_lens.copy_to_device(num_reqs)
        decode_order = None
        if num_tokens == num_reqs:
            self.decode_order.np[:num_reqs] = np.argsort(-self.seq_lens.np[:num_reqs], kind="stable")
            decode_order = self.decode_order.copy_to_device(num_reqs)
        per_group = [
            AttentionMetadata(
                num_actual_tokens=num_tokens,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_table=block_table.copy_to_device(num_reqs, num_cols),
                slot_mapping=slot_mapping.copy_to_device(num_tokens),
                query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs + 1],
                seq_lens_cpu=self.seq_lens.cpu[:num_reqs],
                decode_order=decode_order,
            )
            for block_table, slot_mapping in zip(self.block_tables, self.slot_mappings)
        ]
        return [per_group[g] for g in self.layer_group]

    def _run_model(self, inputs: StepInputs) -> torch.Tensor:
        graph_size = self._graph_size(inputs)
        if graph_size is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        # The graph reads the step buffers the inputs were copied into.
        self._pad_decode_batch(inputs.num_reqs, graph_size)
        graph, hidden_states = self.cuda_graphs[graph_size]
        graph.replay()
        return hidden_states[: inputs.num_reqs]

    def _pad_decode_batch(self, num_reqs: int, size: int) -> None:
        """Fill rows ``num_reqs..size`` of the device step buffers with dummy decodes that read the
        null block and write nowhere."""
        self.query_start_loc.device[num_reqs : size + 1] = self.arange[num_reqs : size + 1]
        self.seq_lens.device[num_reqs:size] = 1
        self.decode_order.device[num_reqs:size] = self.arange[num_reqs:size]  # the dummies last
        self.input_ids.device[num_reqs:size] = 0
        self.positions.device[num_reqs:size] = 0
        for block_table, slot_mapping in zip(self.block_tables, self.slot_mappings):
            block_table.device[num_reqs:size, 0] = 0
            slot_mapping.device[num_reqs:size] = -1

    def _graph_size(self, inputs: StepInputs) -> int | None:
        """The smallest captured batch that holds this step, when the step is all decodes."""
        if not self.cuda_graphs or inputs.num_tokens != inputs.num_reqs:
            return None
        sizes = self.cuda_graph_batch_sizes
        index = bisect.bisect_left(sizes, inputs.num_reqs)
        return sizes[index] if index < len(sizes) else None

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampling settings of the persistent-batch ``rows`` that sample this step."""
        batch = self.input_batch
        n = len(rows)
        temperature = np.take(batch.temperature, rows, out=self.temperature.np[:n])
        top_k = np.take(batch.top_k, rows, out=self.top_k.np[:n])
        top_p = np.take(batch.top_p, rows, out=self.top_p.np[:n])
        metadata = SamplingMetadata(
            temperature=self.temperature.copy_to_device(n),
            top_k=self.top_k.copy_to_device(n) if top_k.any() else None,
            top_p=self.top_p.copy_to_device(n) if (top_p < 1).any() else None,
            all_greedy=bool((temperature == 0).all()),
            all_random=bool((temperature > 0).all()),
        )
        # A seeded row's randomness depends only on (seed, output position): it survives preemption
        # and does not depend on what else is in the batch.
        seeded = np.flatnonzero(batch.seed[rows] >= 0)
        positions = batch.num_tokens[rows[seeded]] - batch.num_prompt_tokens[rows[seeded]]  # this token's
        row_seeds = [hash((int(batch.seed[rows[i]]), int(p))) & (2**63 - 1) for i, p in zip(seeded, positions)]
        if self._takes_sampler_kernel(metadata):
            seeds = self.seeds.np[:n]
            seeds[:] = self.seed_stream.integers(0, 2**63 - 1, n)  # unseeded rows: the engine's stream
            seeds[seeded] = row_seeds
            metadata.seeds = self.seeds.copy_to_device(n)
        else:
            metadata.generators = {int(i): torch.Generator(device=self.device).manual_seed(seed)
                                   for i, seed in zip(seeded, row_seeds)}
        return metadata

    def _takes_sampler_kernel(self, metadata: SamplingMetadata) -> bool:
        """Batches that sample draw with the Triton sampler when custom_ops enables it."""
        return "sampler" in self.settings.custom_ops and not metadata.all_greedy

    # -- CUDA graphs ---------------------------------------------------------------------------

    def cuda_graph_sizes(self) -> list[int]:
        # Past a few hundred decodes launch overhead is a small share of a step (vLLM stops at 512 too).
        limit = min(self.settings.max_num_seqs, MAX_CUDA_GRAPH_BATCH)
        sizes = [1, 2, 4, 8] + list(range(16, limit + 1, 16))
        return sorted({s for s in sizes if s <= limit} | {limit})

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture one graph per decode batch size, largest first so smaller ones reuse its memory.

        A graph bakes in its kernels and buffer addresses, not sequence lengths: the attention backend
        reads those from the device, so one graph serves every decode step of its size."""
        pool = None
        for size in reversed(self.cuda_graph_sizes()):
            self._pad_decode_batch(0, size)
            metadata = [
                AttentionMetadata(
                    num_actual_tokens=size,
                    max_query_len=1,
                    max_seq_len=self.settings.max_model_len,
                    query_start_loc=self.query_start_loc.device[: size + 1],
                    seq_lens=self.seq_lens.device[:size],
                    block_table=self.block_tables[g].device[:size],
                    slot_mapping=self.slot_mappings[g].device[:size],
                    query_start_loc_cpu=self.query_start_loc.cpu[: size + 1],
                    seq_lens_cpu=self.seq_lens.cpu[:size],
                    decode_order=self.decode_order.device[:size],
                )
                for g in self.layer_group
            ]
            args = (self.input_ids.device[:size], self.positions.device[:size], metadata)
            self.model(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden_states = self.model(*args)
            pool = graph.pool()
            self.cuda_graphs[size] = (graph, hidden_states)
        torch.cuda.synchronize()
        self.cuda_graph_batch_sizes = sorted(self.cuda_graphs)
        logger.info("captured CUDA graphs for decode batch sizes %s", sorted(self.cuda_graphs))

    # -- start-up runs --------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest step the scheduler can plan, with a one-block KV cache, to measure peak
        activation memory."""
        settings = self.settings
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(2, 1, settings.block_size, layer.num_kv_heads, layer.head_size,
                                         dtype=settings.dtype, device=self.device)
        self._dummy_step(profile_query_lens(settings.max_num_seqs, settings.max_num_batched_tokens,
                                            settings.max_model_len))
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(0)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the kernels eager steps use before the first request, not in the middle of
        serving: the largest step the scheduler can plan (as the profile run: one prompt as long as a
        request can be, the whole token budget), and one of short prompt chunks. Decode steps are
        compiled when their graphs are captured. The largest step also leaves the allocator holding
        blocks of a full step's activation sizes: in a process whose warm-up step had 4,096 tokens,
        the first timed recipe run spent 0.39 s in its nine 16,384-token prefill steps and a second
        run 0.29 s (H200, 5794f63). Whether this warm-up closes that gap is not measured yet."""
        settings = self.settings
        self._dummy_step(profile_query_lens(settings.max_num_seqs, settings.max_num_batched_tokens,
                                            settings.max_model_len))
        self._dummy_step(np.full(min(settings.max_num_seqs, settings.max_num_batched_tokens // 2, 8), 2, np.int32))

    def _dummy_step(self, query_lens: np.ndarray) -> None:
        """A forward pass and sampling over dummy requests with these query lengths. Every position
        reads block 0 and writes nowhere: the values are garbage, the memory use and the kernels run
        are real."""
        settings = self.settings
        num_reqs, num_tokens = len(query_lens), int(query_lens.sum())
        query_start_loc = torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32))
        seq_lens = torch.from_numpy(query_lens)
        max_query_len = int(query_lens.max())
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_query_len,
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=seq_lens.to(self.device),
            # As wide as the step buffers' tables: Triton specialises kernels on the row stride.
            block_table=torch.zeros(num_reqs, -(-settings.max_model_len // settings.block_size),
                                    dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(int(n)) for n in query_lens]).to(self.device)
        hidden = self.model(input_ids, positions, [metadata] * len(self.model.attention_layers()))
        logits = self.model.compute_logits(hidden[query_start_loc[1:].to(self.device).long() - 1])
        # Both routes a sampling batch can take, as the runner's metadata sends it: with top-k / top-p
        # (the sort is the sampler's largest buffer) and without, so the variants of both sampler
        # kernels (model-dtype and fp32 logits) compile here. A Sampler with a generator of its own
        # keeps the engine's stream and torch's global one untouched.
        temperature = torch.ones(num_reqs, device=self.device)
        top_k = torch.full((num_reqs,), 50, dtype=torch.int32, device=self.device)
        top_p = torch.full((num_reqs,), 0.9, device=self.device)
        takes_kernel = "sampler" in self.settings.custom_ops
        seeds = torch.zeros(num_reqs, dtype=torch.int64, device=self.device) if takes_kernel else None
        sampler = Sampler(torch.Generator(device=self.device))
        for filters in ((top_k, top_p), (None, None)):
            sampler(logits, SamplingMetadata(temperature, *filters, all_greedy=False, all_random=True, seeds=seeds))


def profile_query_lens(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> np.ndarray:
    """The query lengths of the largest step the scheduler can plan: as many requests as it runs,
    as many tokens as the budget allows, the first one as long as a request can be."""
    num_reqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_reqs * max_model_len)
    query_lens = np.ones(num_reqs, np.int32)
    query_lens[0] = min(max_model_len, num_tokens - (num_reqs - 1))
    if num_reqs > 1:  # the rest of the tokens, spread evenly over the other requests
        rest = num_tokens - int(query_lens[0])
        query_lens[1:] = rest // (num_reqs - 1)
        query_lens[1 : 1 + rest % (num_reqs - 1)] += 1
    return query_lens
