"""Top-k / top-p thresholds (``top_k_top_p_threshold``) keep exactly the tokens that a plain sort-based
definition keeps, written here token by token: top-k keeps the tokens at least as large as the k-th
largest logit; top-p, on the softmax of that set, keeps a token when the mass of the tokens strictly
above it is at most ``top_p``; ``top_k`` 0 and ``top_p`` 1 are off. On the PyTorch route rows with a
top-k take their best candidates (``torch.topk``) and rows with top-p alone their whole row, sorted
(``sorted_top_p_threshold``); the Triton route searches every row (``triton_top_k_top_p``, under
TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from micro_vllm.sampling import triton_top_k_top_p
from micro_vllm.sampling.sampler import (Sampler, SamplingMetadata, max_top_k, sorted_top_p_threshold,
                                         top_k_top_p_threshold)

VOCAB = 96
ROUTES = ["pytorch", "triton"]


def reference_kept(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    kept = torch.zeros_like(logits, dtype=torch.bool)
    for row, (x, k, p) in enumerate(zip(logits, top_k, top_p)):
        ordered = x.sort(descending=True).values
        in_top_k = x >= (ordered[min(k, len(x)) - 1] if k > 0 else float("-inf"))
        probs = x.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
        mass_above = (probs * (x > x.unsqueeze(-1))).sum(dim=-1)  # of the tokens above each token
        kept[row] = in_top_k & ((mass_above <= p) if p < 1 else True)
    return kept


def tied_logits(num_rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Logits on a coarse grid: many tokens share a value, at every rank."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab, generator=generator) * 4).round() / 2


def threshold(logits, top_k: torch.Tensor, top_p: torch.Tensor, route: str = "pytorch",
              candidates: int | None = None) -> torch.Tensor:
    """The thresholds of a route as the Sampler asks for them (None for a filter no row uses);
    ``candidates``: more than the batch needs."""
    k = top_k if bool((top_k > 0).any()) else None
    p = top_p if bool((top_p < 1).any()) else None
    if route == "triton":
        return triton_top_k_top_p.top_k_top_p_threshold(logits, k, p)
    whole_rows = bool(((top_p < 1) & (top_k == 0)).any())
    return top_k_top_p_threshold(logits, k, p, candidates or max_top_k(top_k.cpu().numpy()), whole_rows)


def masked(logits, top_k: list[int], top_p: list[float], route: str = "pytorch", candidates: int | None = None):
    """``logits`` with -inf for the tokens below their thresholds."""
    k = torch.tensor(top_k, dtype=torch.int32)
    p = torch.tensor(top_p, dtype=torch.float32)
    return logits.masked_fill(logits < threshold(logits, k, p, route, candidates), float("-inf"))


def check(logits, top_k: list[int], top_p: list[float], route: str = "pytorch",
          candidates: int | None = None) -> None:
    result = masked(logits, top_k, top_p, route, candidates)
    expected = reference_kept(logits, top_k, top_p)
    assert torch.equal(result.isfinite(), expected & logits.isfinite())
    assert torch.equal(result[expected], logits[expected])  # the kept logits are left as they were


@pytest.mark.parametrize("candidates", [None, VOCAB], ids=["top-candidates", "whole-rows"])
@pytest.mark.parametrize("top_p", [0.9, 0.5, 1e-6, 1.0])
@pytest.mark.parametrize("top_k", [1, 5, 17, VOCAB, VOCAB + 50])
def test_every_row_with_top_k(top_k, top_p, candidates):
    """Tied logits (a tie at every rank), and untied ones."""
    untied = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    for logits in (tied_logits(6, 0), untied):
        check(logits, [top_k] * 6, [top_p] * 6, candidates=candidates)


def test_the_triton_search_with_top_k():
    """Every setting of ``test_every_row_with_top_k`` as the rows of one batch, through the search."""
    settings = [(k, p) for k in (1, 5, 17, VOCAB, VOCAB + 50) for p in (0.9, 0.5, 1e-6, 1.0)]
    untied = torch.randn(len(settings), VOCAB, generator=torch.Generator().manual_seed(1))
    for logits in (tied_logits(len(settings), 0), untied):
        check(logits, [k for k, _ in settings], [p for _, p in settings], "triton")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("top_p", [0.95, 0.3, 1e-6])
def test_top_p_alone(top_p, route):
    logits = tied_logits(5, 2)
    check(logits, [0] * 5, [top_p] * 5, route)
    check(torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)), [0] * 5, [top_p] * 5, route)


@pytest.mark.parametrize("route", ROUTES)
def test_mixed_rows(route):
    """Rows without a filter keep everything beside rows with top-k, top-p, both; -inf tokens (as
    min-p or a grammar leave them) stay masked, and a top-k past the finite tokens keeps them all."""
    logits = tied_logits(8, 3)
    logits[2, 10:] = float("-inf")
    logits[5, ::3] = float("-inf")
    top_k = [0, 3, 50, 8, 0, 12, 1, 20]
    top_p = [1.0, 1.0, 0.8, 0.6, 1.0, 0.99, 0.5, 1e-6]
    check(logits, top_k, top_p, route)
    top_p[4] = 0.7  # a row with top-p alone: its whole row
    check(logits, top_k, top_p, route)
    logits[4] = float("-inf")  # all -inf: nothing to keep, nothing to fail
    assert masked(logits, top_k, top_p, route)[4].isneginf().all()


def test_the_triton_search_scales_the_logits_as_the_sampler_does():
    """Given each row's inverse temperature, the search finds on bf16 logits the thresholds of
    ``logits.float() * (1 / T)``, which the Sampler would otherwise make first, bit for bit: the
    PyTorch route's on them."""
    logits = (torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(9)) * 3).to(torch.bfloat16)
    inverse_temperature = 1 / torch.tensor([0.3, 0.6, 1.0, 1.7, 0.6, 1.0, 0.45, 2.5])
    top_k = torch.tensor([0, 0, 0, 0, 0, 0, 7, 30], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.2, 1.0, 1e-6, 1.0, 0.8])
    scaled = logits.float() * inverse_temperature.unsqueeze(-1)
    searched = triton_top_k_top_p.top_k_top_p_threshold(logits, top_k, top_p, inverse_temperature)
    assert torch.equal(searched, threshold(scaled, top_k, top_p, "triton"))
    assert torch.equal(searched, threshold(scaled, top_k, top_p))


def test_a_row_keeps_the_same_tokens_alone_and_in_a_batch():
    """Alone, a row's candidates are its own top-k; beside a row with a larger top-k or one with
    top-p alone, more candidates or the whole sorted row: the same tokens each time."""
    logits = tied_logits(3, 5)
    top_k, top_p = [6, 40, 0], [0.8, 0.9, 0.6]
    alone = masked(logits[:1], top_k[:1], top_p[:1])
    for rows in (2, 3):
        for candidates in (None, VOCAB):
            assert torch.equal(masked(logits[:rows], top_k[:rows], top_p[:rows], candidates=candidates)[0], alone[0])


def test_max_top_k_is_the_largest_top_k_rounded_up():
    """Rounded up to a power of two: the counts start-up loads topk's kernels for."""
    assert max_top_k(np.array([0, 4, 30], np.int32)) == 32
    assert [max_top_k(np.array([k], np.int32)) for k in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert max_top_k(np.zeros(3, np.int32)) is None


@pytest.mark.parametrize("use_triton", [False, True], ids=["pytorch", "triton"])
def test_the_sampler_draws_only_kept_tokens(use_triton):
    """Many draws per row through each route with top-k, top-p, both: every token drawn is kept,
    and a row whose nucleus is one token always draws it."""
    repeats = 12 if use_triton else 40  # the interpreter is slow
    logits = tied_logits(5, 4).repeat(repeats, 1)
    num_rows = len(logits)
    top_k = torch.tensor([5, 0, 40, 2, 0] * repeats, dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.7, 1e-6, 0.5] * repeats)
    sampler = Sampler(use_triton=use_triton, max_num_reqs=num_rows)
    metadata = SamplingMetadata(torch.ones(num_rows), top_k, top_p, all_greedy=False, all_random=True,
                                max_top_k=max_top_k(top_k.numpy()), top_p_without_top_k=True)
    sampled = sampler(logits, sampler.add_row_seeds(metadata, {})).sampled_token_ids
    kept = reference_kept(logits, top_k.tolist(), top_p.tolist())
    assert kept[torch.arange(num_rows), sampled].all()
    assert len(set(sampled[1::5].tolist())) > 5  # the unfiltered row draws widely
    assert len(set(sampled[4::5].tolist())) > 1 and kept[4].sum() < VOCAB / 2  # top-p alone draws in its nucleus


@pytest.mark.parametrize("candidates", [None, VOCAB], ids=["top-candidates", "whole-rows"])
def test_a_tie_at_the_kth_logit_weighs_in_top_p_with_all_its_tokens(candidates):
    """Top-k 2 over one logit of 3 and fifty of 0 keeps all 51; the 3 holds e^3 / (e^3 + 50) < 0.3 of
    their mass, so top-p 0.5 keeps the zeros too (counted as one token, the 3 would hold 0.95)."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0] = 3.0
    logits[0, 20:70] = 0.0
    check(logits, [2], [0.5], candidates=candidates)
    assert reference_kept(logits, [2], [0.5]).sum() == 51


@pytest.mark.parametrize("parallel_passes", [0, 1, 4])
def test_the_search_cuts_its_bracket_until_it_can_gather_it(monkeypatch, parallel_passes):
    """The search's passes at sizes that make them do the work of 151,936-token rows on a few
    thousand: 8 pivots and room for 16 tokens take several cutting passes; a tie of 300 tokens at
    the threshold fills the bracket past its room until it is one value wide; top-p near 1 and a
    top-k of thousands put the threshold among thousands of small tokens; a row of one finite token
    keeps it. Rows are cut in chunks of 512 tokens as many times as ``parallel_passes`` allows, and
    those still too full are cut on by their own program (all of them with none), the same
    thresholds either way: by mass (top-p), by count (top-k), and by mass over a top-k set."""
    monkeypatch.setattr(triton_top_k_top_p, "_PIVOTS", 8)
    monkeypatch.setattr(triton_top_k_top_p, "_CAP", 16)
    monkeypatch.setattr(triton_top_k_top_p, "_SEARCH_BLOCK", 128)
    monkeypatch.setattr(triton_top_k_top_p, "_CHUNK", 512)
    monkeypatch.setattr(triton_top_k_top_p, "_PARALLEL_PASSES", parallel_passes)
    vocab = 3000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(7)) * 2
    logits[1] /= 4
    logits[1, :300] = 1.5  # tied, with a few tokens above: the nucleus of top-p 0.2 ends inside the tie
    logits[3] = float("-inf")
    logits[3, 2999] = -80.0
    top_p = [0.9, 0.2, 0.98, 0.5, 1e-6]
    expected = reference_kept(logits, [0] * 5, top_p)
    assert expected[1, :300].all() and expected[1].sum() < 400 and expected[3].sum() == 1
    check(logits, [0] * 5, top_p, "triton")
    top_k = [50, 100, 2900, 5, 1]  # the 100th of row 1 is in its tie
    assert reference_kept(logits, top_k, [1.0] * 5)[1, :300].all()
    check(logits, top_k, [1.0] * 5, "triton")
    check(logits, [60, 100, 2500, 5, 40], [0.9, 0.95, 0.98, 0.5, 1e-6], "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_triton_search_keeps_what_sorted_rows_keep_at_the_benchmark_shape():
    """On CUDA, 256 rows of bf16 logits (ties at every rank) over 151,936 tokens scaled by 1 / 0.6,
    varied top-k and top-p: torch.topk's candidates, as many as the batch needs or more, keep the
    same tokens as whole sorted rows; the Triton search keeps what they keep, but for tokens whose
    mass above lies within rounding of top-p."""
    torch.manual_seed(0)
    logits = sampler_inputs("cuda")
    top_k = torch.randint(1, 300, (256,), dtype=torch.int32, device="cuda")
    top_p = torch.rand(256, device="cuda") * 0.98 + 0.01
    top_k[::5], top_p[::5] = 0, 1.0  # rows without a filter
    top_p[1::5] = 1.0  # top-k alone
    top_k[2::5] = 0  # top-p alone
    top_p[7::10] = 0.95  # the benchmark's
    logits[2::10] /= 10  # flat rows: nuclei of many thousand tokens
    bound = max_top_k(top_k.cpu().numpy())
    assert int(top_k.max()) <= bound < 2 * int(top_k.max())
    searched = (logits >= threshold(logits, top_k, top_p, "triton"))
    # Whatever the number of candidates (the largest top-k itself, another row's larger one), the same tokens.
    for candidates in (int(top_k.max()), 2000, 151_936):
        sorted_rows = logits >= threshold(logits, top_k, top_p, "pytorch", candidates)
        # Only at the edge of a nucleus (a token, or a tie of them), where fp32 sums of its tokens'
        # mass in two orders may round either way.
        for row, token in (searched != sorted_rows).nonzero().tolist():
            assert top_p[row] < 1
            x = logits[row]
            in_top_k = x >= (x.topk(int(top_k[row])).values[-1] if top_k[row] > 0 else float("-inf"))
            probs = x.double().masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
            assert abs(probs[x > x[token]].sum().item() - top_p[row].item()) < 1e-4
    assert searched[::5].all() and (searched[1::5].sum(dim=-1) >= top_k[1::5]).all()
    assert (searched[2::5].sum(dim=-1) >= 1).all() and (searched[2::10].sum(dim=-1) > 1000).any()


def sampler_inputs(device: str, num_rows: int = 256) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, 151_936, generator=generator, device=device) * 3
    return logits.to(torch.bfloat16).float() * (1 / 0.6)
