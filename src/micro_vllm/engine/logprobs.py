"""One request's logprobs as the user gets them (vLLM's ``LogprobsProcessor``): the runner's rows
made into a dict of ``Logprob`` per position, with each token's text.

A row holds the position's own token first (the sampled one, or the prompt's), then as many top
tokens as the request of its batch that asks for most; the request keeps its own top ``logprobs``.
The own token's rank is its rank in the whole vocabulary; the top tokens are ranked 1, 2, ... A token
that is both keeps the top list's rank (one entry), so a position has ``logprobs`` or
``logprobs + 1`` entries.
``decoded_token`` is the token decoded on its own (as vLLM's ``convert_ids_list_to_tokens``), or None
with ``detokenize=False`` or no tokenizer. ``cumulative_logprob`` sums the sampled tokens' logprobs.
"""

from __future__ import annotations

from micro_vllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs
from micro_vllm.outputs import LogprobsLists
from micro_vllm.sampling.params import SamplingParams


class LogprobsProcessor:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        # Nothing predicts the first prompt token: its entry is None.
        self.prompt_logprobs: PromptLogprobs | None = None if params.prompt_logprobs is None else [None]

    def update_from_output(self, logprobs: LogprobsLists | None, prompt_logprobs: LogprobsLists | None) -> None:
        """Add a step's rows: of the sampled tokens, and of the whole prompt (which comes in one step)."""
        if logprobs is not None:
            self.cumulative_logprob += sum(row[0] for row in logprobs.logprobs)
            self._append(self.logprobs, logprobs, self.num_logprobs)
        if prompt_logprobs is not None:
            self._append(self.prompt_logprobs, prompt_logprobs, self.num_prompt_logprobs)

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs once, for DELTA outputs: afterwards an empty list (None if not asked)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs:
            self.prompt_logprobs = []
        return prompt_logprobs

    def _append(self, positions: list, rows: LogprobsLists, num_logprobs: int) -> None:
        for token_ids, logprobs, rank in zip(*rows):
            count = len(token_ids) if num_logprobs == -1 else 1 + num_logprobs
            token_ids = token_ids[:count]
            ranks = [rank, *range(1, count)]
            texts = self._decode(token_ids)
            positions.append({token_id: Logprob(logprob, rank, text)
                              for token_id, logprob, rank, text in zip(token_ids, logprobs, ranks, texts)})

    def _decode(self, token_ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        return self.tokenizer.batch_decode([[token_id] for token_id in token_ids])
