"""Helpers for tests/test_gpu.py: transformers references on any device, and the rule that decides
whether two greedy token streams agree as far as the arithmetic allows.

Nothing here needs CUDA, so the logic runs (and is checked) on CPU as well.

The rule. Two correct implementations of the same model pick different greedy tokens only where
the reference's two best logits are closer than what their rounding can move (a near tie). So
``check_greedy_agreement`` walks both streams until they first differ and accepts the difference
only if the reference's top-two gap there is below the tolerance; after that point the contexts
differ and nothing more can be compared. A bug shows up as a difference where the gap is large.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

# -- tolerances --------------------------------------------------------------------------------

# bf16 keeps 8 significant bits, so one unit in the last place (ulp) of a value in [2^e, 2^(e+1))
# is 2^(e-7): between 1/256 and 1/128 of the value. Our engine and transformers round every matmul
# output, residual add, norm output and the logits themselves to bf16, in different orders (fused
# qkv / gate_up matmuls; fp32 scores and online softmax in our kernel vs bf16 scores in transformers'
# eager attention), so the same logit computed by both differs by a few ulps of the largest logit M:
# the final rounding alone can put them 1 ulp apart, and the final hidden state carries a relative
# error of a few 2^-9 per element, which a 256-term dot product turns into about 1-2 ulps of M.
# Measured on CPU (bf16, the models of test_gpu.py, 4 families x 8 prompts x 40 positions, 1063
# positions where both had the same context): the largest difference of any logit between our engine
# and transformers was 3.5 ulps of M, the 99th percentile 2.5 ulps, the median 0.5 ulp.
# If every logit of two implementations is within D of the other's, they can pick different argmaxes
# only where the reference's top-two gap is below 2 D. We allow D = 5 ulps (1.4x the worst measured),
# so the tolerance is 10 ulps of M (4-8% of M). It excuses a difference only at a near tie: elsewhere
# (about 80% of positions with these models, whose typical gap is ~10% of M) identity is required.
BF16_TIE_ULPS = 10

# fp32 keeps 24 bits. Measured the same way in fp32, our logits and transformers' differ by at most
# 1.2e-6 of M (median 6e-7); on a GPU, different reduction orders and RoPE angles computed by a
# different pow() add errors of the same order. 2^-13 of M (1.2e-4 M, 100x the measured difference)
# excuses only what is, for every practical purpose, an exact tie: one position in 640 of the
# measured trajectories had a gap that small (7.8e-6 M).
FP32_TIE_FRACTION = 2.0**-13


def tie_tolerance(max_abs_logit: float, dtype: torch.dtype) -> float:
    """How close the top-two logits of a reference computed in ``dtype`` must be to call it a tie."""
    m = max(abs(max_abs_logit), 1e-6)
    if dtype == torch.float32:
        return FP32_TIE_FRACTION * m
    if dtype == torch.bfloat16:
        return BF16_TIE_ULPS * bf16_ulp(m)
    raise ValueError(f"no tie tolerance for {dtype}")


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at magnitude ``x`` (> 0)."""
    return 2.0 ** (math.floor(math.log2(x)) - 7)


# -- transformers references -------------------------------------------------------------------


def load_hf(path: Path, dtype: torch.dtype, device: str | torch.device) -> PreTrainedModel:
    """The saved model loaded back by transformers with eager attention (the plainest reference)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


@dataclass(frozen=True)
class Reference:
    """A greedy continuation and, at each of its positions, the reference's tie tolerance and
    top-two logit gap (the logits as the reference computed them, in its dtype)."""

    tokens: list[int]
    gaps: list[float]
    tols: list[float]


def _device_of(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: list[int], num_tokens: int) -> Reference:
    """Plain greedy decoding with full recomputation each step: nothing an engine could share a
    bug with. Records the top-two gap of transformers' own logits at every step."""
    device, dtype = _device_of(model), next(model.parameters()).dtype
    ids = torch.tensor([prompt], device=device)
    tokens, gaps, tols = [], [], []
    for _ in range(num_tokens):
        logits = model(ids).logits[0, -1].float()
        top = logits.topk(2)
        token, first, second, biggest = top.indices[0], top.values[0], top.values[1], logits.abs().max()
        first, second, biggest, token_id = torch.stack([first, second, biggest, token.float()]).tolist()
        tokens.append(int(token_id))
        gaps.append(first - second)
        tols.append(tie_tolerance(biggest, dtype))
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return Reference(tokens, gaps, tols)


@torch.no_grad()
def hf_gaps_along(model: PreTrainedModel, prompt: list[int], tokens: list[int]) -> Reference:
    """Teacher forcing: the reference's gap and tolerance before each token of ``tokens`` (one
    forward over prompt + tokens), and its own greedy choice there (``Reference.tokens``)."""
    device, dtype = _device_of(model), next(model.parameters()).dtype
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
    logits = model(ids).logits[0, len(prompt) - 1 :].float()  # the logits that choose tokens[i]
    top = logits.topk(2, dim=-1)
    gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
    tols = [tie_tolerance(m, dtype) for m in logits.abs().amax(dim=-1).tolist()]
    return Reference(top.indices[:, 0].tolist(), gaps, tols)


# -- the comparison ----------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two streams differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Agreement:
    compared: int  # positions held to identity (all of them when the streams are identical)
    error: str | None  # why the difference is not acceptable, None when it is (or there is none)


def check_greedy_agreement(ours: list[int], theirs: list[int], reference: Reference, what: str = "") -> Agreement:
    """Accept ``ours`` against ``theirs`` if they are identical, or if they first differ at a
    position where ``reference`` (computed on the common prefix) has a near tie."""
    i = first_difference(ours, theirs)
    if i is None:
        return Agreement(len(ours), None)
    if i >= min(len(ours), len(theirs)):
        return Agreement(i, f"{what}: lengths differ ({len(ours)} vs {len(theirs)}) with identical tokens")
    gap, tol = reference.gaps[i], reference.tols[i]
    if gap < tol:
        return Agreement(i, None)
    return Agreement(
        i,
        f"{what}: diverged at output position {i} ({ours[i]} vs {theirs[i]}) where the reference's "
        f"top-two gap is {gap:.4g} >= tolerance {tol:.4g}; ours={ours}, theirs={theirs}",
    )
