"""vLLM's logits processors, applied on the device to a step's logits, all rows in one batch.

``apply_logits_processors`` runs before the greedy argmax, in vLLM V1's order: ``allowed_token_ids``
masks every other token, then per-token biases (``bad_words`` and ``min_tokens`` ban tokens with
-inf, ``logit_bias`` adds its values), then the penalties: ``repetition_penalty`` on tokens of the
prompt or the output (positive logits divided by it, negative ones multiplied), then
``frequency_penalty`` times each token's count in the output and ``presence_penalty`` for each
token the output holds. ``apply_min_p`` filters the temperature-scaled logits, before top-k / top-p.

The runner gathers the inputs for the rows that use a processor (``ModelRunner._sampling_metadata``);
a batch that uses none has no ``LogitsProcessorsMetadata`` and never reaches this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBiases:
    """Sparse additions to the logits: ``values[i]`` goes to token ``token_ids[i]`` of step row
    ``rows[i]``; -inf bans the token. A (row, token) may appear more than once (a banned token with
    a bias, two bad words ending in the same token): the additions are summed."""

    rows: torch.Tensor  # int64 [m]
    token_ids: torch.Tensor  # int64 [m]
    values: torch.Tensor  # float32 [m]


@dataclass
class Penalties:
    """The penalties of the step rows ``rows``, with their tokens as the device counts them."""

    rows: torch.Tensor  # int64 [m], rows of the step's logits
    presence: torch.Tensor  # float32 [m]
    frequency: torch.Tensor  # float32 [m]
    repetition: torch.Tensor  # float32 [m]
    output_token_counts: torch.Tensor  # int32 [m, vocab]: how often each token occurs in the output
    prompt_token_mask: torch.Tensor  # bool [m, vocab]: whether it occurs in the prompt
    batch_rows: torch.Tensor  # int64 [m]: the runner's rows of those counts, where it counts the sampled tokens


@dataclass
class LogitsProcessorsMetadata:
    """One step's inputs for the processors, on the device; each is None when no row uses it."""

    # allowed_token_ids: the step rows it restricts, and (row, token id) of each allowed token.
    allowed_rows: torch.Tensor | None = None
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    token_biases: TokenBiases | None = None
    penalties: Penalties | None = None


def apply_logits_processors(logits: torch.Tensor, metadata: LogitsProcessorsMetadata) -> torch.Tensor:
    """The processed logits in float32 (a new tensor; ``logits`` is left as it was)."""
    logits = logits.to(torch.float32, copy=True)
    if metadata.allowed_rows is not None:
        banned = torch.zeros_like(logits, dtype=torch.bool)
        banned[metadata.allowed_rows] = True
        banned[metadata.allowed_token_ids] = False
        logits.masked_fill_(banned, float("-inf"))
    biases = metadata.token_biases
    if biases is not None:
        logits.index_put_((biases.rows, biases.token_ids), biases.values, accumulate=True)
    penalties = metadata.penalties
    if penalties is not None:
        logits[penalties.rows] = apply_penalties(logits[penalties.rows], penalties)
    return logits


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (vLLM's, after OpenAI's definition)."""
    counts = penalties.output_token_counts
    in_output = counts > 0
    repetition = penalties.repetition.unsqueeze(-1)
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(in_output | penalties.prompt_token_mask, repeated, logits)
    logits = logits - penalties.frequency.unsqueeze(-1) * counts
    return logits - penalties.presence.unsqueeze(-1) * in_output


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below ``min_p`` times the row's most likely token's
    (``min_p`` 0 keeps every token)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))
