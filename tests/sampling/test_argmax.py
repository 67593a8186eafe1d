"""The sampler's CPU argmax gives ``torch.argmax``'s index: the lowest among ties, NaN as the largest."""

import pytest
import torch

from micro_vllm.sampling.sampler import ARGMAX_CHUNK, cpu_argmax


def rows_with_ties(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    # Few distinct values, so most rows hold their largest several times, in one chunk and across chunks.
    rows = torch.randint(0, 6, (8, vocab), generator=generator).float()
    rows[1] = 3.0  # every entry ties
    rows[2, ARGMAX_CHUNK + 5] = rows[2, 3 * ARGMAX_CHUNK + 1] = 9.0  # the largest, in two later chunks
    rows[3, 2 * ARGMAX_CHUNK + 7] = float("nan")
    rows[3, 4 * ARGMAX_CHUNK] = float("nan")
    rows[4] = float("-inf")
    rows[5, -1] = 7.0  # the largest is the last entry
    return rows


@pytest.mark.parametrize("vocab", [6 * ARGMAX_CHUNK, 6 * ARGMAX_CHUNK + 3])
def test_argmax_matches_torch_argmax(vocab):
    rows = rows_with_ties(vocab)
    assert torch.equal(cpu_argmax(rows), rows.argmax(dim=-1))
    noisy = torch.randn(16, vocab, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_argmax(noisy), noisy.argmax(dim=-1))
    assert torch.equal(cpu_argmax(noisy[:, ::1].t().contiguous().t()), noisy.argmax(dim=-1))  # a strided view
