"""The Triton pass of the penalties (``triton_penalties``) against their PyTorch definition
(``logits_processors.apply_penalties``): bit for bit, from float32 and bfloat16 logits, with rows
without penalties copied. On CPU under TRITON_INTERPRET=1 (conftest), at the benchmark's shape on CUDA."""

from __future__ import annotations

import pytest
import torch

from micro_vllm.sampling import triton_penalties
from micro_vllm.sampling.logits_processors import Penalties, apply_penalties


def penalties_inputs(num_rows: int, vocab: int, penalized: list[int], device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Penalties]:
    """Logits with zeros and -inf among them; counts of 0 to 3 and a prompt mask over every row of
    the batch; on the rows ``penalized``, repetition above and below 1 and frequency / presence of
    either sign, on the others 0, 0 and 1."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=generator, device=device) * 3
    logits[:, ::17] = 0.0
    logits[:, 5::23] = float("-inf")
    counts = (torch.rand(num_rows, vocab, generator=generator, device=device) ** 4 * 4).to(torch.int32)
    prompt_mask = torch.rand(num_rows, vocab, generator=generator, device=device) < 0.1
    presence, frequency, repetition = torch.zeros(num_rows), torch.zeros(num_rows), torch.ones(num_rows)
    m = len(penalized)
    presence[penalized] = torch.linspace(-1.0, 1.5, m)
    frequency[penalized] = torch.linspace(0.7, -0.3, m)
    repetition[penalized] = torch.linspace(0.6, 1.9, m)
    return logits.to(dtype), Penalties(presence.to(device), frequency.to(device), repetition.to(device), counts,
                                       prompt_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_equals_the_definition(monkeypatch, dtype):
    """Rows 0, 2 and 4 of 6 penalized, 300 tokens in blocks of 128 (the last one partial)."""
    monkeypatch.setattr(triton_penalties, "_BLOCK", 128)
    logits, penalties = penalties_inputs(6, 300, [4, 0, 2], dtype=dtype)
    before = logits.clone()
    expected = apply_penalties(logits, penalties)
    result = triton_penalties.apply_penalties(logits, penalties)
    assert result.dtype == expected.dtype == torch.float32
    assert torch.equal(result, expected)
    assert torch.equal(logits, before)  # out of place
    assert torch.equal(result[[1, 3, 5]], logits[[1, 3, 5]].float())  # rows without penalties: copied
    assert not torch.equal(result[[0, 2, 4]], logits[[0, 2, 4]].float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_equals_the_definition_at_the_benchmark_shape(dtype):
    """256 rows of 151,936 logits on CUDA, all but every seventh row penalized: the same bits."""
    penalized = [row for row in range(256) if row % 7]
    logits, penalties = penalties_inputs(256, 151_936, penalized, "cuda", dtype)
    assert torch.equal(triton_penalties.apply_penalties(logits, penalties), apply_penalties(logits, penalties))
