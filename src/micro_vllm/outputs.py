"""What the ModelRunner hands back to the scheduler after a step. Plain Python, so the core can read it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens per scheduled request. A request whose prompt is still being prefilled in
    chunks gets no token this step (an empty list)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]


class AsyncModelRunnerOutput(ABC):
    """A launched step's output, still on its way from the device: the Engine plans the next step
    before it calls ``get_output`` (async scheduling)."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait for the step's sampled tokens and return them."""
