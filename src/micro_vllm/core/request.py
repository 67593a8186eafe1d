"""A request's state as the scheduler sees it: tokens so far, tokens computed, and where it stands."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from micro_vllm.sampling.params import SamplingParams

if TYPE_CHECKING:
    from micro_vllm.structured_output.manager import StructuredOutputGrammar


class RequestStatus(enum.IntEnum):
    """Ordered as vLLM's: every finished status comes after PREEMPTED. An IntEnum, so that the
    comparisons and lookups the engine makes for every request at every step are int's, not the
    Python-level hash of a plain Enum member."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request. There is no prefill or decode phase: the scheduler only compares
    ``num_computed_tokens`` with ``num_tokens`` (prompt plus output so far) plus
    ``num_output_placeholders`` (tokens sampled on the device whose ids have not reached the host)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.bad_words_token_ids = bad_words_token_ids  # sampling_params.bad_words as the tokenizer splits them
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Kept as fields, not computed from the lists: the scheduler reads them for every request
        # at every step.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = len(self.all_token_ids)  # prompt plus output so far
        self.num_computed_tokens = 0  # advanced when a step is scheduled, not when it returns
        self.num_output_placeholders = 0  # sampled in a step still in flight
        # The leading tokens whose ids a plan has carried to the runner (``CachedRequestData.new_token_ids``).
        self.num_sent_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.max_chunk_tokens = 0  # the most tokens one step may compute: set on admission (check_fits)
        # The prompt plus max_tokens, capped by max_model_len: a request stops there (set on admission).
        self.max_num_tokens = 0
        self.block_hashes: list[bytes] = []  # one per full block, filled by the KV cache manager
        # Another request with the same prompt (the first sequence of a parallel-sampling request):
        # the scheduler admits this one once that one's prompt is planned, to reuse its blocks.
        self.prompt_leader: Request | None = None
        # The structured-output matcher, set by the engine when it makes the request; it has accepted
        # exactly the output tokens, so a preempted request's recomputation leaves it as it is.
        self.grammar: StructuredOutputGrammar | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

