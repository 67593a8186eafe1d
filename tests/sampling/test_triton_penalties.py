"""The Triton pass of the penalties (``triton_penalties``) against their PyTorch definition
(``logits_processors.apply_penalties``): bit for bit, on the rows named and on no other. On CPU under
TRITON_INTERPRET=1 (conftest), at the benchmark's shape on CUDA."""

from __future__ import annotations

import pytest
import torch

from micro_vllm.sampling import triton_penalties
from micro_vllm.sampling.logits_processors import Penalties, apply_penalties


def penalties_inputs(num_rows: int, vocab: int, rows: list[int], device: str = "cpu") -> tuple[torch.Tensor, Penalties]:
    """Logits with zeros and -inf among them; counts of 0 to 3 and a prompt mask over every row of
    the batch; per penalized row, repetition above and below 1 and frequency / presence of either sign."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=generator, device=device) * 3
    logits[:, ::17] = 0.0
    logits[:, 5::23] = float("-inf")
    counts = (torch.rand(num_rows, vocab, generator=generator, device=device) ** 4 * 4).to(torch.int32)
    prompt_mask = torch.rand(num_rows, vocab, generator=generator, device=device) < 0.1
    m = len(rows)
    penalties = Penalties(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        presence=torch.linspace(-1.0, 1.5, m, device=device),
        frequency=torch.linspace(0.7, -0.3, m, device=device),
        repetition=torch.linspace(0.6, 1.9, m, device=device),
        output_token_counts=counts,
        prompt_token_mask=prompt_mask,
    )
    return logits, penalties


def test_the_pass_equals_the_definition_on_the_rows_named(monkeypatch):
    """Rows 4, 0, 2 of 6 (out of order), 300 tokens in blocks of 128 (the last one partial)."""
    monkeypatch.setattr(triton_penalties, "_BLOCK", 128)
    logits, penalties = penalties_inputs(6, 300, [4, 0, 2])
    expected = logits.clone()
    apply_penalties(expected, penalties)
    result = logits.clone()
    triton_penalties.apply_penalties(result, penalties)
    assert torch.equal(result, expected)
    assert torch.equal(result[[1, 3, 5]], logits[[1, 3, 5]])  # untouched
    assert not torch.equal(result[[0, 2, 4]], logits[[0, 2, 4]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_pass_equals_the_definition_at_the_benchmark_shape():
    """256 rows of 151,936 logits on CUDA, all but every seventh row penalized: the same bits."""
    rows = [row for row in range(256) if row % 7]
    logits, penalties = penalties_inputs(256, 151_936, rows, "cuda")
    expected = logits.clone()
    apply_penalties(expected, penalties)
    result = logits.clone()
    triton_penalties.apply_penalties(result, penalties)
    assert torch.equal(result, expected)
