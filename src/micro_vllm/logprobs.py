"""What a user gets for logprobs, in vLLM's shape (vLLM's ``vllm/logprobs.py``).

Each position of a sequence has a dict from token id to ``Logprob``: the token at that position
(sampled, or the prompt's) and the top ``logprobs`` (or ``prompt_logprobs``) tokens of the
distribution, so ``n`` or ``n + 1`` entries. ``rank`` is 1-based in the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log probability at one position, its rank (1 is the most likely) and its text
    (``decoded_token``: the token decoded alone; None with ``detokenize=False`` or no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per output token.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]
