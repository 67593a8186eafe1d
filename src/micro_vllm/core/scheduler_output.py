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

    from micro_vllm.core.request import Request

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV cache group


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption: it starts over, with
    every token it has (what later plans' ``new_token_ids`` count from)."""

    req_id: str
    token_ids: tuple[int, ...]  # prompt plus any output already generated
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int  # tokens served by the prefix cache
    # What the logits processors need beside the params: min_tokens holds back EOS too.
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def from_request(cls, request: Request, block_ids: BlockIds) -> NewRequestData:
        """``request`` as it joins the batch, with every token it has and its computed count."""
        return cls(
            req_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=request.eos_token_ids,
            bad_words_token_ids=request.bad_words_token_ids,
        )


@dataclass(frozen=True)
class CachedRequestData:
    """The requests the runner already holds, as parallel lists (vLLM's layout: no object per
    request): their new tokens and blocks, and how far each has been computed before the step.

    ``new_token_ids`` (vLLM's name) holds, for each request, the output token ids that
    ``update_from_output`` has appended to it since the last plan that listed it, as new or cached;
    empty when there are none (a prompt chunk, or a step planned before the last one's token is
    back). With async scheduling a step's input token is often still in flight when it is planned:
    the runner takes it from its own sampling on the device, and the id comes with a later plan. The
    tokens a request samples after the last plan that lists it are never carried."""

    req_ids: tuple[str, ...]
    new_token_ids: tuple[tuple[int, ...], ...]
    new_block_ids: tuple[BlockIds | None, ...]  # None: no new block (most decodes)
    num_computed_tokens: tuple[int, ...]


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
    # The bitmask is valid until the next plan is made (Scheduler.get_grammar_bitmask).
    structured_output_request_ids: Mapping[str, int] = field(default_factory=dict)
    grammar_bitmask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("num_scheduled_tokens", "structured_output_request_ids"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
