"""Top-k / top-p masking without a sort of the vocabulary (``apply_top_k_top_p``) keeps exactly the
tokens that a plain sort-based definition keeps, written here token by token: top-k keeps the tokens
at least as large as the k-th largest logit; top-p, on the softmax of that set, keeps a token when
the mass of the tokens strictly above it is at most ``top_p``; ``top_k`` 0 and ``top_p`` 1 are off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from micro_vllm.sampling.sampler import Sampler, SamplingMetadata, apply_top_k_top_p, max_top_k

VOCAB = 96


def reference_kept(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    kept = torch.zeros_like(logits, dtype=torch.bool)
    for row, (x, k, p) in enumerate(zip(logits, top_k, top_p)):
        ordered = x.sort(descending=True).values
        in_top_k = x >= (ordered[min(k, len(x)) - 1] if k > 0 else float("-inf"))
        probs = x.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
        mass_above = torch.stack([probs[x > value].sum() for value in x])
        kept[row] = in_top_k & ((mass_above <= p) if p < 1 else True)
    return kept


def tied_logits(num_rows: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid: many tokens share a value, at every rank."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, VOCAB, generator=generator) * 4).round() / 2


def check(logits, top_k: list[int], top_p: list[float], use_candidates: bool) -> None:
    k = torch.tensor(top_k, dtype=torch.int32)
    p = torch.tensor(top_p, dtype=torch.float32)
    bound = max_top_k(k.numpy(), p.numpy()) if use_candidates else None
    masked = apply_top_k_top_p(logits, k if any(top_k) else None, p if min(top_p) < 1 else None, bound)
    expected = reference_kept(logits, top_k, top_p)
    assert torch.equal(masked.isfinite(), expected & logits.isfinite())
    assert torch.equal(masked[expected], logits[expected])  # the kept logits are left as they were


@pytest.mark.parametrize("use_candidates", [True, False], ids=["top-candidates", "sorted-rows"])
@pytest.mark.parametrize("top_p", [0.9, 0.5, 1e-6, 1.0])
@pytest.mark.parametrize("top_k", [1, 5, 17, VOCAB, VOCAB + 50])
def test_every_row_with_top_k(top_k, top_p, use_candidates):
    """Tied logits (a tie at every rank), and untied ones."""
    untied = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    for logits in (tied_logits(6, 0), untied):
        check(logits, [top_k] * 6, [top_p] * 6, use_candidates)


@pytest.mark.parametrize("top_p", [0.95, 0.3, 1e-6])
def test_top_p_alone_sorts_whole_rows(top_p):
    logits = tied_logits(5, 2)
    assert max_top_k(np.zeros(5, np.int32), np.full(5, top_p, np.float32)) is None
    check(logits, [0] * 5, [top_p] * 5, use_candidates=True)


@pytest.mark.parametrize("use_candidates", [True, False], ids=["top-candidates", "sorted-rows"])
def test_mixed_rows(use_candidates):
    """Rows without a filter keep everything beside rows with top-k, top-p, both; -inf tokens (as
    min-p or a grammar leave them) stay masked, and a top-k past the finite tokens keeps them all."""
    logits = tied_logits(8, 3)
    logits[2, 10:] = float("-inf")
    logits[5, ::3] = float("-inf")
    top_k = [0, 3, 50, 8, 0, 12, 1, 20]
    top_p = [1.0, 1.0, 0.8, 0.6, 1.0, 0.99, 0.5, 1e-6]
    check(logits, top_k, top_p, use_candidates)
    top_p[4] = 0.7  # a row with top-p alone: whole rows
    check(logits, top_k, top_p, use_candidates)


def test_a_row_keeps_the_same_tokens_alone_and_in_a_batch():
    """Alone, a row's candidates are its own top-k; beside a row with a larger top-k or one with
    top-p alone, more candidates or the whole sorted row: the same tokens each time."""
    logits = tied_logits(3, 5)
    top_k = torch.tensor([6, 40, 0], dtype=torch.int32)
    top_p = torch.tensor([0.8, 0.9, 0.6])
    alone = apply_top_k_top_p(logits[:1], top_k[:1], top_p[:1], 6)
    for rows in (2, 3):
        bound = max_top_k(top_k[:rows].numpy(), top_p[:rows].numpy())
        assert torch.equal(apply_top_k_top_p(logits[:rows], top_k[:rows], top_p[:rows], bound)[0], alone[0])


def test_max_top_k_is_the_largest_top_k_rounded_up_while_every_top_p_row_has_one():
    """Rounded up to a power of two: the counts start-up loads topk's kernels for."""
    top_k = np.array([0, 4, 30], np.int32)
    assert max_top_k(top_k, np.array([1.0, 0.5, 1.0], np.float32)) == 32
    assert [max_top_k(np.array([k], np.int32), np.ones(1, np.float32)) for k in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert max_top_k(top_k, np.array([0.9, 0.5, 1.0], np.float32)) is None
    assert max_top_k(np.zeros(3, np.int32), np.ones(3, np.float32)) is None


def test_the_sampler_draws_only_kept_tokens():
    """Many draws per row through the PyTorch route with top-k and top-p: every token drawn is kept,
    and a row whose nucleus is one token always draws it."""
    logits = tied_logits(4, 4).repeat(50, 1)
    num_rows = len(logits)
    top_k = torch.tensor([5, 0, 40, 2] * 50, dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.7, 1e-6] * 50)
    metadata = SamplingMetadata(torch.ones(num_rows), top_k, top_p, all_greedy=False, all_random=True,
                                max_top_k=max_top_k(top_k.numpy(), top_p.numpy()))
    sampled = Sampler(use_triton=False)(logits, metadata).sampled_token_ids
    kept = reference_kept(logits, top_k.tolist(), top_p.tolist())
    assert kept[torch.arange(num_rows), sampled].all()
    assert len(set(sampled[1::4].tolist())) > 5  # the unfiltered row draws widely


@pytest.mark.parametrize("use_candidates", [True, False], ids=["top-candidates", "sorted-rows"])
def test_a_tie_at_the_kth_logit_weighs_in_top_p_with_all_its_tokens(use_candidates):
    """Top-k 2 over one logit of 3 and fifty of 0 keeps all 51; the 3 holds e^3 / (e^3 + 50) < 0.3 of
    their mass, so top-p 0.5 keeps the zeros too (counted as one token, the 3 would hold 0.95)."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0] = 3.0
    logits[0, 20:70] = 0.0
    check(logits, [2], [0.5], use_candidates)
    assert reference_kept(logits, [2], [0.5]).sum() == 51


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_top_candidates_keep_what_sorted_rows_keep_at_the_benchmark_shape():
    """On CUDA, 256 rows of bf16 logits (ties at every rank) over 151,936 tokens scaled by 1 / 0.6,
    varied top-k and top-p: torch.topk's candidates, as many as the batch needs or more, keep the
    same tokens as whole sorted rows."""
    torch.manual_seed(0)
    logits = sampler_inputs("cuda")
    top_k = torch.randint(1, 300, (256,), dtype=torch.int32, device="cuda")
    top_p = torch.rand(256, device="cuda") * 0.98 + 0.01
    top_k[::5], top_p[::5] = 0, 1.0  # rows without a filter
    top_p[1::5] = 1.0  # top-k alone
    bound = max_top_k(top_k.cpu().numpy(), top_p.cpu().numpy())
    assert int(top_k.max()) <= bound < 2 * int(top_k.max())
    candidates = apply_top_k_top_p(logits, top_k, top_p, bound).isfinite()
    # Whatever the number of candidates (the largest top-k itself, another row's larger one), the same tokens.
    for other_bound in (int(top_k.max()), 2000, None):
        assert torch.equal(candidates, apply_top_k_top_p(logits, top_k, top_p, other_bound).isfinite())
    assert candidates[::5].all() and (candidates[1::5].sum(dim=-1) >= top_k[1::5]).all()


def sampler_inputs(device: str, num_rows: int = 256) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, 151_936, generator=generator, device=device) * 3
    return logits.to(torch.bfloat16).float() * (1 / 0.6)
