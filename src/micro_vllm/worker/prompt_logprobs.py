"""Prompt logprobs (``SamplingParams.prompt_logprobs``): for each request that asks, the raw logprobs
of each prompt token given the tokens before it, computed chunk by chunk as the prompt is.

In a step, a request's tokens whose next token is a prompt token predict it (the last of a chunk
predicts the first of the next): their logits are computed at once and their rows copied to the host
without blocking. A request's chunks are kept until the step that computes its last prompt token, and
its whole prompt's rows go out with the first token it samples. A request preempted before that
computes its prompt anew (its chunks are dropped); one preempted after it resumes with that token
and needs none (``InputBatch.add_request``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer
from micro_vllm.sampling.sampler import LogprobsTensors, compute_logprobs, gather_logprobs
from micro_vllm.worker.input_batch import InputBatch


@dataclass(frozen=True)
class PromptLogprobsSlice:
    """The tokens of one request in a step whose next token is a prompt token."""

    req_id: str
    tokens: slice  # in the step's tokens (maybe none); the tokens they predict are at the same indices of the targets
    num_logprobs: int
    # The step computes the prompt's last token (and samples): the prompt's logprobs go out with that token.
    completes: bool


class PromptLogprobs:
    """The prompt logprobs of the requests in progress, and the staged targets of a step's tokens."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        self.targets = CpuGpuBuffer((max_num_tokens,), torch.int64, device)
        # Per request, its prompt logprobs computed so far (host copies by chunk), until its last chunk.
        self.in_progress: dict[str, list[LogprobsTensors]] = {}

    def forget(self, req_id: str) -> None:
        self.in_progress.pop(req_id, None)

    def clear(self) -> None:
        self.in_progress.clear()

    def plan(self, batch: InputBatch, query_start_loc: np.ndarray, num_scheduled: np.ndarray,
             num_tokens: int) -> tuple[list[PromptLogprobsSlice], torch.Tensor | None]:
        """The slices of the step's rows that ask for prompt logprobs and their targets, staged and
        copied to the device; a row whose prompt the step completes asks for none any more."""
        rows = np.flatnonzero(batch.num_prompt_logprobs[: batch.num_reqs] >= 0)
        if not len(rows):
            return [], None
        targets = self.targets.np
        slices = []
        for row in rows.tolist():
            num_prompt_tokens = int(batch.num_prompt_tokens[row])
            start = int(batch.num_computed_tokens[row])
            stop = start + int(num_scheduled[row])
            end = min(stop, num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
            first = int(query_start_loc[row])
            tokens = slice(first, first + end - start)
            targets[tokens] = batch.token_ids[row, start + 1 : end + 1]
            completes = stop == num_prompt_tokens
            slices.append(PromptLogprobsSlice(batch.req_ids[row], tokens, int(batch.num_prompt_logprobs[row]),
                                              completes))
            if completes:
                batch.num_prompt_logprobs[row] = -1
        return slices, self.targets.copy_to_device(num_tokens)

    def compute(self, slices: list[PromptLogprobsSlice], targets: torch.Tensor, hidden_states: torch.Tensor,
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, list[LogprobsTensors]]:
        """The logprobs of the prompt tokens the step's slices predict, copied to the host without
        blocking; returns the whole prompt's of each request whose prompt the step completes."""
        completed = {}
        for part in slices:
            chunks = self.in_progress.setdefault(part.req_id, [])
            if part.tokens.stop > part.tokens.start:
                logits = compute_logits(hidden_states[part.tokens])
                chunks.append(gather_logprobs(compute_logprobs(logits), part.num_logprobs,
                                              targets[part.tokens]).to_host())
            if part.completes:
                completed[part.req_id] = self.in_progress.pop(part.req_id)
        return completed
