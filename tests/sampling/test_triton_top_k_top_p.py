"""The Triton kernel for rows with top-k and top-p (``triton_top_k_top_p``, under TRITON_INTERPRET=1 on
CPU) gives the threshold of the PyTorch definition (``sampler.top_k_top_p_of_candidates``), bit for
bit: on bf16 logits with inverse temperatures, on fp32 ones with or without, with ties at the k-th
inside the candidates and past them, and whatever number of candidates the batch took.

The two add the top-p sums in other orders and precisions (the kernel in fp32 blocks, which the
interpreter scans left to right; PyTorch's CPU cumsum in double), so they could differ where a
candidate's mass before it lies within rounding of ``top_p``; these random and grid-valued rows put
none there, so the tests ask for equality. The compiled kernel's grouping of the sums is checked on
CUDA, at the benchmark's shape."""

from __future__ import annotations

import pytest
import torch

from micro_vllm.sampling.sampler import max_top_k, top_k_top_p_of_candidates
from micro_vllm.sampling.triton_top_k_top_p import top_k_top_p_threshold

VOCAB = 1000
# Rows without a filter, with top-k alone, top-p alone (-inf here: the whole-row search does them),
# both; k at the edges (1, the candidates' count, past the vocabulary in the case that allows it).
TOP_K = [0, 1, 5, 50, 64, 17, 3, 0, 40, 64]
TOP_P = [0.9, 0.5, 1.0, 0.9, 0.95, 1e-6, 0.3, 1.0, 0.99, 0.7]


def grid_logits(num_rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Logits on a coarse grid: ties at every rank, inside the candidates and past them."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab, generator=generator) * 4).round() / 2


def thresholds(logits: torch.Tensor, top_k: list[int], top_p: list[float], inverse_temperature=None,
               num_candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's thresholds and the definition's, from the same candidates (as many as the
    batch's ``max_top_k``, or ``num_candidates``)."""
    k = torch.tensor(top_k, dtype=torch.int32)
    p = torch.tensor(top_p, dtype=torch.float32)
    count = min(num_candidates or max_top_k(k.numpy()), logits.shape[-1])
    candidates = logits.topk(count, dim=-1).values
    return (top_k_top_p_threshold(candidates, logits, k, p, inverse_temperature),
            top_k_top_p_of_candidates(candidates, logits, k, p, inverse_temperature))


@pytest.mark.parametrize("dtype, scaled", [(torch.bfloat16, True), (torch.float32, True), (torch.float32, False)],
                         ids=["bf16-inverse-temperature", "fp32-inverse-temperature", "fp32-scaled"])
@pytest.mark.parametrize("values", ["random", "grid"])
def test_the_kernel_gives_the_definitions_thresholds(dtype, scaled, values):
    """Mixed rows; bf16 logits come with their inverse temperatures (as the Sampler passes them),
    fp32 ones with or without (scaled already)."""
    num_rows = len(TOP_K)
    logits = grid_logits(num_rows, 1) if values == "grid" else torch.randn(num_rows, VOCAB) * 3
    logits = logits.to(dtype)
    inverse_temperature = 1 / torch.linspace(0.3, 1.7, num_rows) if scaled else None
    kernel, definition = thresholds(logits, TOP_K, TOP_P, inverse_temperature)
    assert torch.equal(kernel, definition)
    assert kernel[[0, 7]].isneginf().all() and kernel.isfinite().sum() == num_rows - 2


def test_a_top_k_past_the_vocabulary_takes_every_token():
    """A top-k larger than the vocabulary makes every token a candidate (not a power of two), the
    last tied with the k-th where the row ends in a tie; a row of one finite token keeps it."""
    logits = grid_logits(4, 2, vocab=300)
    logits[1, :5] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0])
    logits[1, 5:] = -3.0  # the k-th tie runs to the end of the row: 0.54 of the mass is above it
    logits[2] = float("-inf")
    logits[2, 7] = 1.0
    kernel, definition = thresholds(logits, [400, 400, 400, 2], [0.9, 0.99, 0.5, 0.8], num_candidates=300)
    assert torch.equal(kernel, definition)
    assert kernel[1].item() == -3.0 and kernel[2].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tie_past_the_last_candidate_is_counted_over_the_whole_row(dtype):
    """One logit of 3 and fifty of 0 (a tie that runs past the 8 candidates), top-k 2: the 3 holds
    e^3 / (e^3 + 50) < 0.3 of the mass, so top-p 0.5 keeps the zeros (threshold 0); counted over the
    candidates alone, the tie would leave it 0.95 and keep the 3 alone. A tie of three that ends
    inside the candidates (top-k 3 over 3, 1, 1, 1, -2, ...) is counted there: top-p 0.8 keeps it
    (the 3 holds e^3 / (e^3 + 3 e) < 0.72; beside one 1 alone, 0.88)."""
    logits = torch.full((3, VOCAB), -5.0)
    logits[:2, 0] = 3.0
    logits[:2, 20:70] = 0.0
    logits[2, :4] = torch.tensor([3.0, 1.0, 1.0, 1.0])
    logits[2, 4:8] = -2.0
    logits = logits.to(dtype)
    inverse_temperature = torch.ones(3) if dtype == torch.bfloat16 else None
    top_k, top_p = [2, 2, 3], [0.5, 0.2, 0.8]
    kernel, definition = thresholds(logits, top_k, top_p, inverse_temperature, num_candidates=8)
    assert torch.equal(kernel, definition)
    assert kernel.flatten().tolist() == [0.0, 3.0, 1.0]


def test_a_rows_threshold_does_not_depend_on_the_batchs_candidates():
    """Each row alone, with its own top-k's candidates, and in a batch whose largest top-k (200)
    takes 256 of them or the whole row: the same threshold, bit for bit."""
    logits = torch.cat([grid_logits(3, 3), torch.randn(3, VOCAB) * 2]).to(torch.bfloat16)
    inverse_temperature = 1 / torch.tensor([0.6, 1.0, 0.35, 0.8, 1.3, 0.6])
    top_k, top_p = [60, 40, 7, 50, 12, 64], [0.9, 0.95, 0.6, 0.9, 0.99, 0.5]
    alone = torch.cat([thresholds(logits[row:row + 1], top_k[row:row + 1], top_p[row:row + 1],
                                  inverse_temperature[row:row + 1])[0] for row in range(len(top_k))])
    assert alone.isfinite().all()
    batch = thresholds(torch.cat([logits, logits[:1]]), top_k + [200], top_p + [0.9],
                       torch.cat([inverse_temperature, inverse_temperature[:1]]))[0]
    assert torch.equal(batch[:-1], alone)
    whole_rows = thresholds(logits, top_k, top_p, inverse_temperature, num_candidates=VOCAB)[0]
    assert torch.equal(whole_rows, alone)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_gives_the_definitions_thresholds_at_the_benchmark_shape():
    """On CUDA, 256 rows of bf16 logits over 151,936 tokens with varied top-k, top-p and
    temperatures: the kernel's thresholds do not change with the number of candidates, and are the
    definition's but where a row's kept set ends at a candidate whose mass before it lies within
    rounding of ``top_p`` (fp32 sums of the same terms in other orders)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_rows, vocab = 256, 151_936
    logits = (torch.randn(num_rows, vocab, generator=generator, device="cuda") * 3).to(torch.bfloat16)
    top_k = torch.randint(1, 300, (num_rows,), generator=generator, device="cuda", dtype=torch.int32)
    top_p = torch.rand(num_rows, generator=generator, device="cuda") * 0.98 + 0.01
    top_k[::7], top_p[1::7] = 0, 1.0
    inverse_temperature = 1 / (torch.rand(num_rows, generator=generator, device="cuda") * 1.5 + 0.2)
    candidates = logits.topk(max_top_k(top_k.cpu().numpy()), dim=-1).values
    kernel = top_k_top_p_threshold(candidates, logits, top_k, top_p, inverse_temperature)
    definition = top_k_top_p_of_candidates(candidates, logits, top_k, top_p, inverse_temperature)
    # The compiled sums group a row's terms the same way whatever the number of candidates.
    more_candidates = logits.topk(2048, dim=-1).values
    assert torch.equal(top_k_top_p_threshold(more_candidates, logits, top_k, top_p, inverse_temperature), kernel)
    assert kernel[::7].isneginf().all() and kernel.isfinite().sum() == num_rows - len(range(0, num_rows, 7))
    scaled = logits.float() * inverse_temperature.unsqueeze(-1)
    for row in (kernel != definition).flatten().nonzero().flatten().tolist():
        x = scaled[row]
        top_k_set = x[x >= x.topk(int(top_k[row])).values[-1]].double()
        weights = (top_k_set - top_k_set.max()).exp()
        lower = min(kernel[row].item(), definition[row].item())
        mass_before = (weights[top_k_set > lower].sum() / weights.sum()).item()
        assert abs(mass_before - top_p[row].item()) < 1e-5, (row, kernel[row], definition[row])
