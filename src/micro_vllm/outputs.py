"""What the ModelRunner hands back to the scheduler after a step (vLLM's ``v1/outputs.py``); what the
user gets is ``engine/request_output.py``. Plain Python, so the core can read it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple


class LogprobsLists(NamedTuple):
    """Logprobs of some positions on the host (vLLM's name), one row per position: the position's
    own token (sampled, or the prompt's next token) first, then the top-k tokens, best first."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # the rank of each row's own token in the whole vocabulary (1 is the best)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens per scheduled request. A request whose prompt is still being prefilled in
    chunks gets no token this step (an empty list).

    ``logprobs`` maps each request that asked for logprobs and sampled a token to that token's row;
    ``prompt_logprobs_dict`` each request that asked for prompt logprobs to the rows of its whole
    prompt (from its second token on), in the step that samples its first token."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)


class AsyncModelRunnerOutput(ABC):
    """A launched step's output, still on its way from the device: the Engine plans the next step
    before it calls ``get_output`` (async scheduling)."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait for the step's sampled tokens and return them."""
