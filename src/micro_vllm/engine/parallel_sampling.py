"""Parallel sampling (``SamplingParams.n > 1``), as vLLM does it: a parent request fans out into ``n``
child requests, each an ordinary request with ``n=1``, and their outputs are gathered back into one
``RequestOutput`` per parent, whose ``outputs`` are the sequences by index.

Child ``i`` has vLLM's id ``f"{i}_{parent_id}"`` and, when the parent is seeded, the seed
``seed + i``: sequence ``i`` is what the prompt alone with that seed gives. The prompt is computed
once: the scheduler admits the other children only once the first child's prompt is planned
(``Request.prompt_leader``), when every full block of it is hashed, and the prefix cache hands them
those blocks; each computes only the prompt's last block (a hit never covers the last token, whose
logits each child needs). With prefix caching off every child computes the whole prompt, as in vLLM.
"""

from __future__ import annotations

import dataclasses

from micro_vllm.core.request import Request
from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
from micro_vllm.sampling.params import RequestOutputKind, SamplingParams


class ParentRequest:
    """A request with ``n > 1``: its children, and what their outputs have given so far."""

    def __init__(self, request: Request) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.output_kind = params.output_kind
        self.children = [
            Request(f"{index}_{request.request_id}", request.prompt_token_ids, child_params,
                    request.eos_token_ids, request.arrival_time, request.bad_words_token_ids)
            for index, child_params in enumerate(_child_params(params))
        ]
        for child in self.children[1:]:
            child.prompt_leader = self.children[0]
        # The first sequence takes the matcher made with the request; each other one needs its own
        # (a matcher follows one sequence's tokens), which the engine makes.
        self.children[0].grammar = request.grammar
        # Each child's latest completion, for the FINAL_ONLY and CUMULATIVE outputs.
        self.completions: list[CompletionOutput | None] = [None] * params.n
        self.num_unfinished = params.n

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def make_output(self, child_outputs: list[RequestOutput]) -> RequestOutput | None:
        """The parent's output for one step's outputs of some of its children: FINAL_ONLY once all
        are finished, every sequence so far with CUMULATIVE, the sequences that moved with DELTA.
        None while a FINAL_ONLY parent still runs."""
        for output in child_outputs:
            [completion] = output.outputs
            self.completions[completion.index] = completion
            if completion.finished():
                self.num_unfinished -= 1
        if self.output_kind is RequestOutputKind.DELTA:
            outputs = sorted((output.outputs[0] for output in child_outputs), key=lambda c: c.index)
        elif self.output_kind is RequestOutputKind.CUMULATIVE:
            outputs = [c or _no_tokens_yet(i) for i, c in enumerate(self.completions)]
        elif self.finished:
            outputs = list(self.completions)
        else:
            return None
        # The prompt's side of the output is the children's; the first child's prefix-cache hit is
        # what earlier requests saved (the others reuse the first child's blocks).
        return dataclasses.replace(
            child_outputs[0], request_id=self.request_id, outputs=outputs, finished=self.finished,
            num_cached_tokens=max(self.children[0].num_cached_tokens, 0),
        )


def _child_params(params: SamplingParams) -> list[SamplingParams]:
    """Each child's settings: the parent's with ``n=1``, and seed ``seed + i`` for child ``i``."""
    if params.seed is None:
        return [dataclasses.replace(params, n=1)] * params.n
    return [dataclasses.replace(params, n=1, seed=params.seed + index) for index in range(params.n)]


def _no_tokens_yet(index: int) -> CompletionOutput:
    return CompletionOutput(index=index, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
