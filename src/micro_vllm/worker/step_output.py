"""A launched step's output on its way from the device to the host (vLLM's
``AsyncGPUModelRunnerOutput``): the engine holds it while it plans the next step, and ``get_output``
waits for the copies and makes the ``ModelRunnerOutput``."""

from __future__ import annotations

import numpy as np
import torch

from micro_vllm.cpu_gpu_buffer import copy_to_host
from micro_vllm.outputs import AsyncModelRunnerOutput, LogprobsLists, ModelRunnerOutput
from micro_vllm.sampling.sampler import LogprobsTensors, SamplerOutput


class DeviceStepOutput(AsyncModelRunnerOutput):
    """The tokens one step sampled, one per request (``samples`` says which are new tokens; the
    others are a prompt chunk's and dropped), copied to pinned host memory behind an event, with the
    logprobs some requests asked for: ``logprobs_rows`` are the rows whose request asked,
    ``prompt_logprobs`` the host copies, chunk by chunk, of the whole prompt of each request whose
    first token the step samples. Everything is queued before the event."""

    def __init__(self, req_ids: list[str], samples: np.ndarray, sampled: SamplerOutput | None,
                 logprobs_rows: np.ndarray | None = None,
                 prompt_logprobs: dict[str, list[LogprobsTensors]] | None = None) -> None:
        self.req_ids = req_ids
        self.samples = samples
        self.host = None if sampled is None else copy_to_host(sampled.sampled_token_ids)
        self.logprobs = None
        if sampled is not None and sampled.logprobs_tensors is not None:
            self.logprobs = sampled.logprobs_tensors.to_host()
        self.logprobs_rows = logprobs_rows
        self.prompt_logprobs = prompt_logprobs or {}
        self.ready: torch.cuda.Event | None = None
        if sampled is not None and sampled.sampled_token_ids.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def get_output(self) -> ModelRunnerOutput:
        if self.host is None:  # an empty step
            return ModelRunnerOutput(self.req_ids, [])
        if self.ready is not None:
            self.ready.synchronize()
        # A column's tolist makes the one-token lists in one call, not a comprehension.
        tokens = self.host.numpy().reshape(-1, 1).tolist()
        for row in np.flatnonzero(~self.samples).tolist():
            tokens[row] = []
        logprobs = {}
        if self.logprobs is not None:
            lists = self.logprobs.tolists()
            for row in self.logprobs_rows.tolist():
                logprobs[self.req_ids[row]] = LogprobsLists([lists.logprob_token_ids[row]], [lists.logprobs[row]],
                                                            [lists.ranks[row]])
        prompt_logprobs = {req_id: LogprobsTensors.cat(chunks).tolists()
                           for req_id, chunks in self.prompt_logprobs.items()}
        return ModelRunnerOutput(self.req_ids, tokens, logprobs, prompt_logprobs)
