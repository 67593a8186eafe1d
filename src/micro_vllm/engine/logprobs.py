"""One request's logprobs as the user gets them (vLLM's ``LogprobsProcessor``): the runner's rows
made into a dict of ``Logprob`` per position, with each token's text.

A row holds the position's own token first (the sampled one, or the prompt's), then as many top
tokens as the request of its batch that asks for most; the request keeps its own top ``logprobs``.
The own token's rank is its rank in the whole vocabulary; the top tokens are ranked 1, 2, ... A token
that is both keeps the top list's rank (one entry), so a position has ``logprobs`` or
``logprobs + 1`` entries.
``decoded_token`` is the token decoded on its own (as vLLM's ``convert_ids_list_to_tokens``), or None
with ``detokenize=False`` or no tokenizer: each token id once per engine, in ``token_texts``, which
the output processor shares between its requests. ``cumulative_logprob`` sums the sampled tokens' logprobs.
"""

from __future__ import annotations

from micro_vllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs
from micro_vllm.outputs import LogprobsLists
from micro_vllm.sampling.params import SamplingParams


class LogprobsProcessor:
    def __init__(self, tokenizer, params: SamplingParams, token_texts: dict[int, str]) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        self.token_texts = token_texts
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        # Nothing predicts the first prompt token: its entry is None.
        self.prompt_logprobs: PromptLogprobs | None = None if params.prompt_logprobs is None else [None]

    def update_from_output(self, logprobs: LogprobsLists | None, prompt_logprobs: LogprobsLists | None) -> None:
        """Add a step's rows: of the sampled tokens, and of the whole prompt (which comes in one step)."""
        if logprobs is not None:
            for row in logprobs.logprobs:
                self.cumulative_logprob += row[0]
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
        count = None if num_logprobs == -1 else 1 + num_logprobs
        token_ids = [ids[:count] for ids in rows.logprob_token_ids]
        texts = self._texts(token_ids)
        for ids, logprobs, own_rank in zip(token_ids, rows.logprobs, rows.ranks):
            positions.append({token_id: Logprob(logprob, rank, texts.get(token_id))
                              for token_id, logprob, rank in zip(ids, logprobs, (own_rank, *range(1, len(ids))))})

    def _texts(self, token_ids: list[list[int]]) -> dict[int, str]:
        """The text of each token of ``token_ids`` by id: decoded the first time the engine meets it
        (empty with ``detokenize=False`` or no tokenizer)."""
        if self.tokenizer is None:
            return {}
        new = list({token_id for ids in token_ids for token_id in ids}.difference(self.token_texts))
        if new:
            self.token_texts.update(zip(new, self.tokenizer.batch_decode([[token_id] for token_id in new])))
        return self.token_texts
