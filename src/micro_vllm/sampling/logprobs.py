"""Logprobs on the device, in the logits pass that samples: the top-k of a row's log-softmax, and
the log probability and rank of one token of the row (the sampled token, or the prompt's next one).

They are the raw logprobs (vLLM's default ``logprobs_mode``): of the model's logits before
temperature, penalties or any filter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from micro_vllm.cpu_gpu_buffer import copy_to_host
from micro_vllm.outputs import LogprobsLists


class LogprobsTensors(NamedTuple):
    """One row per position (vLLM's name): the position's own token first, then the top k, best first."""

    logprob_token_ids: torch.Tensor  # int64 [n, 1 + k]
    logprobs: torch.Tensor  # float32 [n, 1 + k]
    ranks: torch.Tensor  # int64 [n]: of the own token in the whole vocabulary, 1 the best

    def to_host(self) -> LogprobsTensors:
        """Pinned host copies, queued without blocking (see ``copy_to_host``)."""
        return LogprobsTensors(*(copy_to_host(t) for t in self))

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())

    @staticmethod
    def cat(chunks: list[LogprobsTensors]) -> LogprobsTensors:
        """The rows of several chunks of positions, in order (the chunks share their k)."""
        return LogprobsTensors(*(torch.cat(parts) for parts in zip(*chunks)))


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The top ``num_logprobs`` of each row of ``logprobs`` [n, vocab], behind the row's own token
    ``token_ids`` [n], its logprob and its rank: 1 + the number of other tokens at least as likely
    (vLLM's count, so a token tied with others takes the last of their ranks)."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.long().unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(torch.cat((token_ids, top_ids), dim=1), torch.cat((token_logprobs, top_logprobs), dim=1),
                           ranks)
