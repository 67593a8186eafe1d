"""vLLM's logits processors, applied on the device to a step's logits, all rows in one batch.

``apply_logits_processors`` runs before the greedy argmax, in vLLM V1's order: ``allowed_token_ids``
masks every other token, then per-token biases (``logit_bias`` adds its values; ``bad_words`` and
``min_tokens`` ban tokens with -inf), then the penalties: ``repetition_penalty`` on tokens of the
prompt or the output (positive logits divided by it, negative ones multiplied), then
``frequency_penalty`` times each token's count in the output and ``presence_penalty`` for each
token the output holds (in PyTorch here, or in one Triton pass, ``triton_penalties.py``, on the
Sampler's Triton route). ``apply_min_p`` filters the temperature-scaled logits, before top-k / top-p.

The runner's ``InputBatch`` makes the inputs from its rows' settings when its rows change, and each
step adds the tokens ``min_tokens`` and ``bad_words`` ban at that step (they depend on the output so
far); a batch that uses no processor has no ``LogitsProcessorsMetadata`` and never reaches this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBiases:
    """Sparse additions to the logits: ``values[i]`` goes to token ``token_ids[i]`` of row ``rows[i]``;
    -inf bans the token. A (row, token) may appear more than once (two bad words ending in the same
    token): the additions are summed."""

    rows: torch.Tensor  # int64 [m]
    token_ids: torch.Tensor  # int64 [m]
    values: torch.Tensor  # float32 [m]


@dataclass(frozen=True)
class Penalties:
    """Every row's penalties (0, 0 and 1 for a row without them), and where the runner counts every
    row's tokens on the device."""

    presence: torch.Tensor  # float32 [n], one per row of the batch and of its logits
    frequency: torch.Tensor  # float32 [n]
    repetition: torch.Tensor  # float32 [n]
    output_token_counts: torch.Tensor  # int32 [rows, vocab]: how often each token occurs in a row's output
    prompt_token_mask: torch.Tensor  # bool [rows, vocab]: whether it occurs in the row's prompt


@dataclass(frozen=True)
class LogitsProcessorsMetadata:
    """A batch's inputs for the processors, on the device; each is None when no row uses it."""

    # allowed_token_ids: the rows it restricts, and (row, token id) of each allowed token.
    allowed_rows: torch.Tensor | None = None
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: TokenBiases | None = None
    bans: TokenBiases | None = None  # this step's: min_tokens and bad words
    penalties: Penalties | None = None


# The logits [n, vocab] penalized, as a new float32 tensor.
PenaltiesApplier = Callable[[torch.Tensor, Penalties], torch.Tensor]


def apply_logits_processors(logits: torch.Tensor, metadata: LogitsProcessorsMetadata,
                            penalize: PenaltiesApplier) -> torch.Tensor:
    """The processed logits in float32 (a new tensor; ``logits`` is left as it was). ``penalize``
    applies the penalties: ``apply_penalties``, or the Triton pass of ``triton_penalties`` on the
    Sampler's Triton route; either writes a new float32 tensor, so that a batch with the penalties
    alone reads its logits once."""
    penalties_alone = metadata.penalties is not None and all(
        field is None for field in (metadata.allowed_rows, metadata.logit_bias, metadata.bans))
    processed = logits if penalties_alone else logits.to(torch.float32, copy=True)
    if metadata.allowed_rows is not None:
        banned = torch.zeros_like(processed, dtype=torch.bool)
        banned[metadata.allowed_rows] = True
        banned[metadata.allowed_token_ids] = False
        processed.masked_fill_(banned, float("-inf"))
    for biases in (metadata.logit_bias, metadata.bans):
        if biases is not None:
            processed.index_put_((biases.rows, biases.token_ids), biases.values, accumulate=True)
    return processed if metadata.penalties is None else penalize(processed, metadata.penalties)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (vLLM's, after OpenAI's definition), on
    every row of ``logits``, as a new float32 tensor; a row with 0, 0 and 1 keeps its values.

    Only the tokens a row has seen, in its output or its prompt, change: they are computed alone
    (a few thousand a row), not the whole vocabulary of every row of the batch. Finding them waits
    for the device, which on CUDA the default route does not: there the Triton pass
    (``triton_penalties``) runs instead."""
    out = logits.to(torch.float32, copy=True)
    counts = penalties.output_token_counts[: len(logits)]
    rows, tokens = ((counts > 0) | penalties.prompt_token_mask[: len(logits)]).nonzero(as_tuple=True)
    seen, count = out[rows, tokens], counts[rows, tokens]
    repetition = penalties.repetition[rows]
    seen = torch.where(seen > 0, seen / repetition, seen * repetition)
    out[rows, tokens] = seen - penalties.frequency[rows] * count - penalties.presence[rows] * (count > 0)
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below ``min_p`` times the row's most likely token's
    (``min_p`` 0 keeps every token)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))
