"""Top-k / top-p thresholds (``top_k_top_p_threshold``) keep exactly the tokens that a plain sort-based
definition keeps, written here token by token: top-k keeps the tokens at least as large as the k-th
largest logit; top-p, on the softmax of that set, keeps a token when the mass of the tokens strictly
above it is at most ``top_p``; ``top_k`` 0 and ``top_p`` 1 are off. Rows with a top-k take their
best candidates (``torch.topk``); rows with top-p alone take their whole row, sorted
(``sorted_top_p_threshold``) or searched by the Triton kernel (``triton_top_p``, under
TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from micro_vllm.sampling import triton_top_p
from micro_vllm.sampling.sampler import (Sampler, SamplingMetadata, max_top_k, sorted_top_p_threshold,
                                         top_k_top_p_threshold)

VOCAB = 96
WHOLE_ROW = {"sorted": sorted_top_p_threshold, "triton": triton_top_p.top_p_threshold}


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


def masked(logits, top_k: list[int], top_p: list[float], whole_row: str = "sorted", candidates: int | None = None):
    """The logits under ``top_k_top_p_threshold`` as the Sampler calls it; ``candidates``: more than
    the batch needs."""
    k = torch.tensor(top_k, dtype=torch.int32)
    p = torch.tensor(top_p, dtype=torch.float32)
    top_p_alone = bool(((p < 1) & (k == 0)).any())
    return below_threshold_masked(logits, k if any(top_k) else None, p if min(top_p) < 1 else None,
                                  candidates or max_top_k(k.numpy()), WHOLE_ROW[whole_row] if top_p_alone else None)


def below_threshold_masked(logits, *args) -> torch.Tensor:
    """``logits`` with -inf for the tokens below ``top_k_top_p_threshold(logits, *args)``."""
    return logits.masked_fill(logits < top_k_top_p_threshold(logits, *args), float("-inf"))


def check(logits, top_k: list[int], top_p: list[float], whole_row: str = "sorted",
          candidates: int | None = None) -> None:
    result = masked(logits, top_k, top_p, whole_row, candidates)
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


@pytest.mark.parametrize("whole_row", list(WHOLE_ROW))
@pytest.mark.parametrize("top_p", [0.95, 0.3, 1e-6])
def test_top_p_alone(top_p, whole_row):
    logits = tied_logits(5, 2)
    check(logits, [0] * 5, [top_p] * 5, whole_row)
    check(torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)), [0] * 5, [top_p] * 5, whole_row)


@pytest.mark.parametrize("whole_row", list(WHOLE_ROW))
def test_mixed_rows(whole_row):
    """Rows without a filter keep everything beside rows with top-k, top-p, both; -inf tokens (as
    min-p or a grammar leave them) stay masked, and a top-k past the finite tokens keeps them all."""
    logits = tied_logits(8, 3)
    logits[2, 10:] = float("-inf")
    logits[5, ::3] = float("-inf")
    top_k = [0, 3, 50, 8, 0, 12, 1, 20]
    top_p = [1.0, 1.0, 0.8, 0.6, 1.0, 0.99, 0.5, 1e-6]
    check(logits, top_k, top_p, whole_row)
    top_p[4] = 0.7  # a row with top-p alone: its whole row
    check(logits, top_k, top_p, whole_row)
    logits[4] = float("-inf")  # all -inf: nothing to keep, nothing to fail
    assert masked(logits, top_k, top_p, whole_row)[4].isneginf().all()


@pytest.mark.parametrize("whole_row", list(WHOLE_ROW))
def test_the_whole_row_search_scales_the_logits_as_the_sampler_does(whole_row):
    """Given each row's inverse temperature, the search finds on bf16 logits the threshold of
    ``logits.float() * (1 / T)``, which the Sampler would otherwise make first, bit for bit."""
    logits = (torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(9)) * 3).to(torch.bfloat16)
    inverse_temperature = 1 / torch.tensor([0.3, 0.6, 1.0, 1.7, 0.6, 1.0])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.2, 1.0, 1e-6])
    scaled = logits.float() * inverse_temperature.unsqueeze(-1)
    search = WHOLE_ROW[whole_row]
    assert torch.equal(search(logits, top_p, inverse_temperature), search(scaled, top_p, None))
    assert torch.equal(search(scaled, top_p, None), sorted_top_p_threshold(scaled, top_p))


def test_top_k_candidates_from_the_logits_as_they_are_are_those_of_the_scaled_logits():
    """Selected from bf16 logits (ties at every rank) and scaled after, the candidates give every
    row with a top-k, with or without top-p, the threshold of the scaled logits, bit for bit."""
    logits = tied_logits(8, 11).to(torch.bfloat16)
    inverse_temperature = 1 / torch.tensor([0.3, 0.6, 1.0, 1.7, 0.6, 1.0, 0.45, 2.5])
    top_k = torch.tensor([1, 3, 7, 30, 0, 12, VOCAB, 5], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.8, 1.0, 1e-6, 0.95, 1.0])
    scaled = logits.float() * inverse_temperature.unsqueeze(-1)
    bound = max_top_k(top_k.numpy())
    from_logits = top_k_top_p_threshold(logits, top_k, top_p, bound, None, inverse_temperature)
    assert torch.equal(from_logits, top_k_top_p_threshold(scaled, top_k, top_p, bound))
    assert torch.equal(scaled >= from_logits, reference_kept(scaled, top_k.tolist(), top_p.tolist()))


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
def test_the_top_p_search_cuts_its_bracket_until_it_can_gather_it(monkeypatch, parallel_passes):
    """The search's passes at sizes that make them do the work of 151,936-token rows on a few
    thousand: 8 pivots and room for 16 tokens take several cutting passes; a tie of 300 tokens at
    the threshold fills the bracket past its room until it is one value wide; top-p near 1 puts the
    threshold among thousands of small tokens; a row of one finite token keeps it. Rows are cut in
    chunks of 512 tokens as many times as ``parallel_passes`` allows, and those still too full are cut
    on by their own program (all of them with none), the same thresholds either way."""
    monkeypatch.setattr(triton_top_p, "_PIVOTS", 8)
    monkeypatch.setattr(triton_top_p, "_CAP", 16)
    monkeypatch.setattr(triton_top_p, "_SEARCH_BLOCK", 128)
    monkeypatch.setattr(triton_top_p, "_CHUNK", 512)
    monkeypatch.setattr(triton_top_p, "_PARALLEL_PASSES", parallel_passes)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_top_candidates_and_the_top_p_search_keep_what_sorted_rows_keep_at_the_benchmark_shape():
    """On CUDA, 256 rows of bf16 logits (ties at every rank) over 151,936 tokens scaled by 1 / 0.6,
    varied top-k and top-p: torch.topk's candidates, as many as the batch needs or more, keep the
    same tokens as whole sorted rows; rows with top-p alone keep through the Triton search what
    they keep sorted, but for tokens whose mass above is within rounding of top-p."""
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
    searched = below_threshold_masked(logits, top_k, top_p, bound, triton_top_p.top_p_threshold).isfinite()
    # Whatever the number of candidates (the largest top-k itself, another row's larger one), the same tokens.
    for candidates in (int(top_k.max()), 2000, 151_936):
        sorted_rows = below_threshold_masked(logits, top_k, top_p, candidates, sorted_top_p_threshold).isfinite()
        # Only at the edge of a top-p-alone row (a token, or a tie of them), where fp32 sums of
        # 151,936 terms in two orders may round either way.
        for row, token in (searched != sorted_rows).nonzero().tolist():
            assert top_k[row] == 0
            probs = logits[row].double().softmax(dim=-1)
            assert abs(probs[logits[row] > logits[row, token]].sum().item() - top_p[row].item()) < 1e-4
    assert searched[::5].all() and (searched[1::5].sum(dim=-1) >= top_k[1::5]).all()
    assert (searched[2::5].sum(dim=-1) >= 1).all() and (searched[2::10].sum(dim=-1) > 1000).any()


def sampler_inputs(device: str, num_rows: int = 256) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, 151_936, generator=generator, device=device) * 3
    return logits.to(torch.bfloat16).float() * (1 / 0.6)
