"""The penalties in Triton (``triton_penalties``) against their PyTorch definition
(``logits_processors.apply_penalties``): their pass bit for bit, from float32 and bfloat16 logits,
with rows without penalties copied; the Triton sampler's draw that applies them as it reads the logits
draws what it draws from the pass's output; and the Sampler takes that draw only when nothing else
reads the penalized logits. On CPU under TRITON_INTERPRET=1 (conftest), at the benchmark's shape on CUDA."""

from __future__ import annotations

import pytest
import torch

from micro_vllm.sampling import triton_penalties, triton_sampler
from micro_vllm.sampling.logits_processors import LogitsProcessorsMetadata, Penalties, apply_penalties
from micro_vllm.sampling.sampler import Sampler, SamplingMetadata


def penalties_inputs(num_rows: int, vocab: int, penalized: list[int], device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Penalties]:
    """Logits with zeros and -inf among them; counts of 0 to 3 and the tokens seen (a tenth of them
    in a prompt, and those counted) over every row of the batch; on the rows ``penalized``,
    repetition above and below 1 and frequency / presence of either sign, on the others 0, 0 and 1."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=generator, device=device) * 3
    logits[:, ::17] = 0.0
    logits[:, 5::23] = float("-inf")
    counts = (torch.rand(num_rows, vocab, generator=generator, device=device) ** 4 * 4).to(torch.int32)
    seen = (torch.rand(num_rows, vocab, generator=generator, device=device) < 0.1) | (counts > 0)
    presence, frequency, repetition = torch.zeros(num_rows), torch.zeros(num_rows), torch.ones(num_rows)
    m = len(penalized)
    presence[penalized] = torch.linspace(-1.0, 1.5, m)
    frequency[penalized] = torch.linspace(0.7, -0.3, m)
    repetition[penalized] = torch.linspace(0.6, 1.9, m)
    return logits.to(dtype), Penalties(presence.to(device), frequency.to(device), repetition.to(device), counts,
                                       seen)


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



def draw_inputs(num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperatures between 0.5 and 1.5 (rows 1 and 5 greedy) and one seed per row."""
    temperature = torch.rand(num_rows, generator=torch.Generator().manual_seed(1)) + 0.5
    temperature[[1, 5]] = 0.0
    return temperature, torch.arange(num_rows, dtype=torch.int64) * 7919 + 1


def test_the_draw_penalizes_as_the_pass_does(monkeypatch):
    """Seed for seed, the draw that penalizes as it reads the bf16 logits gives the tokens it gives
    from the pass's fp32 output, greedy rows included, over chunks of 256 tokens; the penalties change
    some draws, and the rows without them draw what they draw without penalties."""
    monkeypatch.setattr(triton_sampler, "_CHUNK", 256)
    monkeypatch.setattr(triton_sampler, "_BLOCK", 64)
    penalized = [row for row in range(24) if row % 3]
    logits, penalties = penalties_inputs(24, 700, penalized, dtype=torch.bfloat16)
    temperature, seeds = draw_inputs(24)
    drawn = triton_sampler.sample(logits, temperature, seeds, penalties=penalties)
    expected = triton_sampler.sample(triton_penalties.apply_penalties(logits, penalties), temperature, seeds)
    assert drawn.tolist() == expected.tolist()
    unpenalized = triton_sampler.sample(logits, temperature, seeds)
    assert drawn[::3].tolist() == unpenalized[::3].tolist()
    assert (drawn[penalized] != unpenalized[penalized]).any()


@pytest.mark.parametrize("filtered", ["none", "top_p", "greedy"])
def test_the_sampler_penalizes_in_the_draw_only_where_nothing_else_reads_the_penalized_logits(filtered):
    """With the penalties the batch's only processor and no filter, the Triton route's draw applies
    them (their pass never runs); beside top-p, or in an all-greedy batch, the pass writes the
    penalized logits the filter or the argmax reads. Each draws what the Sampler draws from those
    logits penalized beforehand."""
    logits, penalties = penalties_inputs(24, 700, [row for row in range(24) if row % 3], dtype=torch.bfloat16)
    temperature, seeds = draw_inputs(24)
    top_p = torch.full((24,), 0.8) if filtered == "top_p" else None
    if filtered == "greedy":
        temperature, seeds = torch.zeros(24), None
    metadata = SamplingMetadata(temperature, None, top_p, all_greedy=filtered == "greedy", all_random=False,
                                seeds=seeds, top_p_without_top_k=top_p is not None)
    sampler, passes = Sampler(use_triton=True), []
    sampler.penalize = lambda *args: passes.append(args) or triton_penalties.apply_penalties(*args)
    drawn = sampler(logits, SamplingMetadata(**{**metadata.__dict__, "logits_processors":
                                               LogitsProcessorsMetadata(penalties=penalties)}))
    expected = Sampler(use_triton=True)(apply_penalties(logits, penalties), metadata)
    assert drawn.sampled_token_ids.tolist() == expected.sampled_token_ids.tolist()
    assert len(passes) == (filtered != "none")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_equals_the_definition_at_the_benchmark_shape(dtype):
    """256 rows of 151,936 logits on CUDA, all but every seventh row penalized: the same bits."""
    penalized = [row for row in range(256) if row % 7]
    logits, penalties = penalties_inputs(256, 151_936, penalized, "cuda", dtype)
    assert torch.equal(triton_penalties.apply_penalties(logits, penalties), apply_penalties(logits, penalties))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_draw_penalizes_as_the_pass_does_at_the_benchmark_shape():
    """256 rows of 151,936 bf16 logits on CUDA, all but every third row penalized: the draw that
    penalizes as it reads gives the tokens it gives from the pass's output."""
    logits, penalties = penalties_inputs(256, 151_936, [row for row in range(256) if row % 3], "cuda",
                                         torch.bfloat16)
    temperature, seeds = (tensor.cuda() for tensor in draw_inputs(256))
    expected = triton_sampler.sample(triton_penalties.apply_penalties(logits, penalties), temperature, seeds)
    assert torch.equal(triton_sampler.sample(logits, temperature, seeds, penalties=penalties), expected)
