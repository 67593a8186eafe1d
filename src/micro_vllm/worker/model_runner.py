"""Executes plans on one device: keeps the persistent batch and the physical KV tensors, builds each
step's input tensors, runs the model and samples.

The runner never sees Request objects: it learns everything from the plan's deltas and keeps the
rest itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from micro_vllm.attention.attention import AttentionMetadata
from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.model_loader.default import load_model
from micro_vllm.outputs import ModelRunnerOutput
from micro_vllm.sampling.sampler import Sampler, SamplingMetadata
from micro_vllm.worker.input_batch import InputBatch


@dataclass(frozen=True)
class RunnerSettings:
    """What the runner needs to know, resolved by the Worker."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    seed: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]  # one per decoder layer
    logits_indices: torch.Tensor  # the last token of each request that samples this step
    sample_rows: np.ndarray  # positions in the step's request order of those requests


class ModelRunner:
    def __init__(self, settings: RunnerSettings, model_path, hf_config) -> None:
        self.settings = settings
        self.device = settings.device
        self.model = load_model(model_path, hf_config, settings.dtype, settings.device, settings.attention_backend)
        self.vocab_size = hf_config.vocab_size
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        self.kv_cache_groups: list[KVCacheGroup] = []
        self.layer_group: list[int] = []  # decoder layer -> its KV cache group
        self.input_batch: InputBatch | None = None

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
        """Allocate each layer's paged K/V tensor and the persistent batch sized for it."""
        self.kv_cache_groups = groups
        num_layers = len(self.model.attention_layers())
        self.layer_group = [0] * num_layers
        for group_id, group in enumerate(groups):
            for layer_index in group.layer_indices:
                self.layer_group[layer_index] = group_id
        block_size = self.settings.block_size
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(
                2, num_blocks, block_size, layer.num_kv_heads, layer.head_size,
                dtype=self.settings.dtype, device=self.device,
            )
            # Every slot is written before it is read, except the null block that stands in for
            # positions outside a sliding window: masked, but multiplied by zero, so it must hold no NaN.
            layer.kv_cache[:, 0].zero_()
        max_blocks = -(-self.settings.max_model_len // block_size)
        self.input_batch = InputBatch(self.settings.max_num_seqs, self.settings.max_model_len, [max_blocks] * len(groups))

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(plan)
        if plan.is_empty:
            return ModelRunnerOutput([], [])
        req_ids = list(plan.num_scheduled_tokens)
        inputs = self._prepare_inputs(plan, req_ids)
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
        sample_req_ids = [req_ids[i] for i in inputs.sample_rows]
        sampled = self.sampler(logits, self._sampling_metadata(sample_req_ids)).tolist()
        tokens: dict[str, list[int]] = {}
        for req_id, token_id in zip(sample_req_ids, sampled):
            self.input_batch.append_token(self.input_batch.row_of[req_id], token_id)
            tokens[req_id] = [token_id]
        return ModelRunnerOutput(req_ids, [tokens.get(r, []) for r in req_ids])

    def _update_states(self, plan: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in plan.finished_req_ids | plan.preempted_req_ids:
            if req_id in batch.row_of:
                batch.remove_request(req_id)
        for new in plan.scheduled_new_reqs:
            batch.add_request(new)
        for cached in plan.scheduled_cached_reqs:
            row = batch.row_of[cached.req_id]
            batch.num_computed_tokens[row] = cached.num_computed_tokens
            batch.append_block_ids(row, cached.new_block_ids)

    def _prepare_inputs(self, plan: SchedulerOutput, req_ids: list[str]) -> StepInputs:
        batch = self.input_batch
        num_reqs = len(req_ids)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int64, num_reqs)
        num_scheduled = np.fromiter(plan.num_scheduled_tokens.values(), np.int32, num_reqs)
        query_start_loc = np.zeros(num_reqs + 1, np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # Token t of the step belongs to request req_of_token[t], at position num_computed + offset.
        req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], num_scheduled)
        num_computed = batch.num_computed_tokens[rows]
        positions = num_computed[req_of_token] + offsets
        token_rows = rows[req_of_token]
        input_ids = batch.token_ids[token_rows, positions]
        seq_lens = (num_computed + num_scheduled).astype(np.int32)

        to_device = self._to_device
        query_start_loc_t = torch.from_numpy(query_start_loc)
        seq_lens_t = torch.from_numpy(seq_lens)
        common = dict(
            num_actual_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=to_device(query_start_loc_t),
            seq_lens=to_device(seq_lens_t),
            query_start_loc_cpu=query_start_loc_t,
            seq_lens_cpu=seq_lens_t,
        )
        block_size = self.settings.block_size
        group_metadata = []
        for table in batch.block_tables:
            step_table = table[rows]
            slots = step_table[np.arange(num_reqs)[req_of_token], positions // block_size].astype(np.int64)
            slots = slots * block_size + positions % block_size
            group_metadata.append(
                AttentionMetadata(
                    block_table=to_device(torch.from_numpy(step_table)),
                    slot_mapping=to_device(torch.from_numpy(slots)),
                    **common,
                )
            )
        # Only requests whose every known token is now computed produce a next token.
        sample_rows = np.nonzero(seq_lens == batch.num_tokens[rows])[0]
        return StepInputs(
            input_ids=to_device(torch.from_numpy(input_ids.astype(np.int64))),
            positions=to_device(torch.from_numpy(positions.astype(np.int64))),
            attn_metadata=[group_metadata[g] for g in self.layer_group],
            logits_indices=to_device(torch.from_numpy(query_start_loc[1:][sample_rows].astype(np.int64) - 1)),
            sample_rows=sample_rows,
        )

    def _sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int64, len(req_ids))
        temperature = batch.temperature[rows]
        top_k = batch.top_k[rows]
        top_p = batch.top_p[rows]
        generators = {}
        for i, row in enumerate(rows):
            params = batch.sampling_params[row]
            if params.seed is not None and not params.greedy:
                # Reseed per output position: the draw depends only on (seed, position), so it survives
                # preemption and does not depend on what else is in the batch.
                position = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
                seed = hash((params.seed, position)) & (2**63 - 1)
                generators[i] = torch.Generator(device=self.device).manual_seed(seed)
        return SamplingMetadata(
            temperature=self._to_device(torch.from_numpy(temperature)),
            top_k=self._to_device(torch.from_numpy(top_k)) if top_k.any() else None,
            top_p=self._to_device(torch.from_numpy(top_p)) if (top_p < 1).any() else None,
            all_greedy=bool((temperature == 0).all()),
            generators=generators,
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    # -- memory profiling ----------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest step the scheduler can produce, without a KV cache, to measure peak
        activation memory."""
        settings = self.settings
        num_tokens = settings.max_num_batched_tokens
        num_reqs = min(settings.max_num_seqs, num_tokens)
        query_lens = np.full(num_reqs, num_tokens // num_reqs, np.int32)
        query_lens[: num_tokens % num_reqs] += 1
        query_start_loc = torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32))
        seq_lens = torch.from_numpy(query_lens)
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(2, 1, settings.block_size, layer.num_kv_heads, layer.head_size,
                                         dtype=settings.dtype, device=self.device)
        max_blocks = -(-int(query_lens.max()) // settings.block_size)
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(query_lens.max()),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=seq_lens.to(self.device),
            block_table=torch.zeros(num_reqs, max_blocks, dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(int(n)) for n in query_lens]).to(self.device)
        hidden = self.model(input_ids, positions, [metadata] * len(self.model.attention_layers()))
        logits = self.model.compute_logits(hidden[query_start_loc[1:].to(self.device).long() - 1])
        temperature = torch.ones(num_reqs, device=self.device)
        self.sampler(logits, SamplingMetadata(temperature, None, None, all_greedy=False))
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(0)
