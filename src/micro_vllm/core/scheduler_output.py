"""The plan of one step: built once by the scheduler, read by the runner, never mutated.

The runner keeps its own per-request state, so the plan carries only what changed: requests that
join the batch (whole), the deltas of those already there, and who left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from micro_vllm.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV cache group


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (it starts over)."""

    req_id: str
    token_ids: tuple[int, ...]  # prompt plus any output already generated
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int  # tokens served by the prefix cache
    # What the logits processors need beside the params: min_tokens holds back EOS too.
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class CachedRequestData:
    """The requests the runner already holds, as parallel lists (vLLM's layout: no object per
    request): their new blocks, how far each has been computed before the step, and the output
    tokens the scheduler appended to each since the last plan that listed it (empty when none; the
    runner learns token values only this way)."""

    req_ids: tuple[str, ...]
    new_block_ids: tuple[BlockIds | None, ...]  # None: no new block (most decodes)
    num_computed_tokens: tuple[int, ...]
    new_token_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Mapping[str, int]  # request id -> tokens to compute, in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str]  # finished or aborted since the last plan: the runner drops them
    preempted_req_ids: frozenset[str]  # preempted this step: the runner drops them too
    # The structured-output requests that sample this step -> their row of ``grammar_bitmask`` (an
    # int32 CPU tensor, one bit per vocabulary id: the tokens each may sample); None when there are none.
    structured_output_request_ids: Mapping[str, int] = field(default_factory=dict)
    grammar_bitmask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # A read-only view is taken as it is: the plans of steps in which the same requests decode
        # share one.
        if not isinstance(self.num_scheduled_tokens, MappingProxyType):
            object.__setattr__(self, "num_scheduled_tokens", MappingProxyType(dict(self.num_scheduled_tokens)))
        object.__setattr__(self, "structured_output_request_ids",
                           MappingProxyType(dict(self.structured_output_request_ids)))

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
