"""The Triton sampler against the definition: greedy rows are torch.argmax (ties included), random
rows follow softmax(logits / T) (the chunk by its mass, then the token inside it), -inf tokens are
never drawn, and a row's draw depends only on its seed. On CPU under TRITON_INTERPRET=1 (conftest),
small vocabularies; small chunk sizes make a few tokens span several chunks."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from micro_vllm.sampling import sampler as sampler_module
from micro_vllm.sampling.sampler import Sampler, SamplingMetadata, max_top_k
from micro_vllm.sampling.triton_sampler import sample


def assert_follows(counts: torch.Tensor, logits: torch.Tensor, temperature: float, top_k: int | None = None) -> None:
    """The token counts of independent draws follow softmax(logits / temperature) (restricted to the
    top k): every count within 5 standard deviations of its expectation, nothing outside the top k,
    and some count outside 5 of them for temperature 1, so the check can tell a wrong temperature."""
    def probabilities(t: float) -> torch.Tensor:
        keep = torch.arange(len(logits)) if top_k is None else logits.topk(top_k).indices
        p = torch.zeros(len(logits), dtype=torch.float64)
        p[keep] = torch.softmax(logits[keep].double() / t, dim=0)
        return p

    def within(p: torch.Tensor) -> torch.Tensor:
        draws = counts.sum()
        return (counts - draws * p).abs() <= 5 * (draws * p * (1 - p)).sqrt() + 1

    expected = probabilities(temperature)
    assert within(expected).all(), (counts / counts.sum(), expected)
    assert not within(probabilities(1.0)).all(), "the draws cannot tell this temperature from 1"


def small_chunks(monkeypatch, chunk: int, block: int) -> None:
    from micro_vllm.sampling import triton_sampler

    monkeypatch.setattr(triton_sampler, "_CHUNK", chunk)
    monkeypatch.setattr(triton_sampler, "_BLOCK", block)


def test_greedy_rows_are_torch_argmax_with_ties_to_the_lowest_index():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    logits[1, [7, 250]] = 9.0  # a tie inside one block
    logits[2, :] = 1.0  # all equal: index 0
    logits = logits.to(torch.bfloat16)
    tokens = sample(logits, torch.zeros(6), torch.arange(6, dtype=torch.int64))
    assert tokens.tolist() == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("chunk, block", [(256, 64), (64, 32)])
def test_ties_across_blocks_and_chunks_keep_the_first(monkeypatch, chunk, block):
    small_chunks(monkeypatch, chunk, block)
    logits = torch.zeros(3, 200)
    logits[0, [10, 150]] = 5.0
    logits[1, [70, 190]] = 5.0
    logits[2, [40, 41]] = 5.0
    assert sample(logits, torch.zeros(3), torch.zeros(3, dtype=torch.int64)).tolist() == [10, 70, 40]


def test_random_rows_follow_the_softmax():
    """800 draws, each with its own seed, over 12 tokens at temperature 0.7 follow
    softmax(logits / 0.7)."""
    vocab, draws, temperature = 12, 800, 0.7
    row = torch.linspace(-4.0, 4.0, vocab)
    logits = row.repeat(draws, 1)
    tokens = sample(logits, torch.full((draws,), temperature), torch.arange(draws, dtype=torch.int64) * 7919)
    assert_follows(torch.bincount(tokens, minlength=vocab).double(), row, temperature)


def test_the_pytorch_route_follows_the_softmax_and_never_draws_minus_inf():
    """The Sampler's PyTorch route (the exponential race, its noise drawn as -log(U)): 4,000 rows of
    12 tokens at temperature 0.7, one of them -inf, follow softmax(logits / 0.7); over 1,000 equally
    likely tokens a row with a seeded generator draws the same token from the same seed, and the same
    token whatever its batch, while the unseeded row beside it draws anew."""
    vocab, draws, temperature = 12, 4000, 0.7
    row = torch.linspace(-4.0, 4.0, vocab)
    row[3] = float("-inf")
    sampler = Sampler(False, seed=0)
    metadata = SamplingMetadata(torch.full((draws,), temperature), None, None, all_greedy=False, all_random=True)
    tokens = sampler(row.repeat(draws, 1), metadata).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[3] == 0
    assert_follows(counts, row, temperature)
    flat, ones = torch.zeros(3, 1000), SamplingMetadata(torch.ones(3), None, None, all_greedy=False, all_random=True)
    draws = [sampler(flat[:n], sampler.add_row_seeds(replace(ones, temperature=torch.ones(n)), {n - 1: 5}))
             .sampled_token_ids.tolist() for n in (2, 2, 3)]
    assert draws[0][1] == draws[1][1] == draws[2][2]
    assert len({draws[0][0], draws[1][0], draws[2][0], draws[2][1]}) > 1


def test_the_chunk_is_drawn_by_its_softmax_mass(monkeypatch):
    """Four chunks of 4 tokens, read 2 at a time, at temperature 0.4: the row's highest token is alone
    in chunk 0 (31% of the mass), four lower ones share chunk 1 (59%), chunk 2 holds the rest and
    chunk 3 is all -inf. Picking the chunk with the highest token, picking chunks uniformly, or
    weighting each chunk's sum without bringing it to the row's maximum would each put a chunk's
    count far outside its mass: at least 8 standard deviations from it with these 400 draws (and the
    tokens' counts 9 from those of temperature 1), where the check allows 5."""
    small_chunks(monkeypatch, 4, 2)
    draws, temperature, inf = 400, 0.4, float("inf")
    row = torch.tensor([-inf, 0.5, -inf, -inf, 0.2, 0.2, 0.2, 0.2, -1.5, -0.8, -0.6, -0.1, -inf, -inf, -inf, -inf])
    tokens = sample(row.repeat(draws, 1), torch.full((draws,), temperature),
                    torch.arange(draws, dtype=torch.int64) * 104729 + 3)
    counts = torch.bincount(tokens, minlength=16).double()
    assert counts[row == -inf].sum() == 0
    assert_follows(counts, row, temperature)
    chunk_counts = counts.view(4, 4).sum(dim=1)
    chunk_mass = torch.softmax(row.double() / temperature, dim=0).view(4, 4).sum(dim=1)
    sd = (draws * chunk_mass * (1 - chunk_mass)).sqrt()
    assert ((chunk_counts - draws * chunk_mass).abs() <= 5 * sd + 1).all(), (chunk_counts / draws, chunk_mass)


@pytest.mark.parametrize("temperature", [0.0, 0.05, 1.0, 5.0])
def test_minus_inf_tokens_are_never_drawn(monkeypatch, temperature):
    """Five chunks of 64 tokens, most of them -inf: row 0 has one finite token (far below 0, in the
    fourth chunk), the others a few spread over chunks 0, 2 and 4; every seed draws among them only."""
    small_chunks(monkeypatch, 64, 32)
    rows, inf = 48, float("inf")
    logits = torch.full((rows, 300), -inf)
    logits[0, 250] = -60.0
    allowed = [3, 130, 131, 299]
    logits[1:, allowed] = torch.tensor([-1.0, 2.0, 2.0, 0.5])
    tokens = sample(logits, torch.full((rows,), temperature), torch.arange(rows, dtype=torch.int64) * 31 + 1)
    assert tokens[0].item() == 250
    assert set(tokens[1:].tolist()) <= set(allowed)


def test_a_rows_draw_depends_only_on_its_seed():
    torch.manual_seed(1)
    logits = torch.randn(5, 50)
    temperature = torch.full((5,), 1.0)
    seeds = torch.tensor([11, 22, 33, 44, 55])
    tokens = sample(logits, temperature, seeds)
    # The same row alone, or among other rows in another order, draws the same token.
    assert sample(logits[3:4], temperature[:1], seeds[3:4]).tolist() == tokens[3:4].tolist()
    order = torch.tensor([4, 3, 0])
    assert sample(logits[order], temperature[order], seeds[order]).tolist() == tokens[order].tolist()
    # Other seeds, other draws (for some row, almost surely).
    assert sample(logits, temperature, seeds + 1).tolist() != tokens.tolist()


@pytest.mark.parametrize("temperature", [1e-4, 0.05])
def test_a_low_temperature_is_nearly_greedy(temperature):
    torch.manual_seed(2)
    logits = torch.randn(8, 100) * 3
    tokens = sample(logits, torch.full((8,), temperature), torch.arange(8, dtype=torch.int64))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def _kernel_metadata(temperature, seeds, top_k=None, top_p=None) -> SamplingMetadata:
    return SamplingMetadata(temperature, top_k, top_p, all_greedy=False, all_random=bool((temperature > 0).all()),
                            seeds=seeds, max_top_k=None if top_k is None else max_top_k(top_k.numpy()))


def test_a_row_draws_the_same_token_beside_filtered_rows():
    """A batch with a top-k row takes per-row thresholds; the other rows (-inf) must keep the draw
    they get without a filter (same scores, same seeds), greedy rows their argmax."""
    torch.manual_seed(3)
    logits = (torch.randn(17, 300) * 2).to(torch.bfloat16)
    temperature = torch.rand(17) + 0.5
    temperature[4] = 0.0
    seeds = torch.arange(17, dtype=torch.int64) * 104729 + 5
    direct = Sampler(use_triton=True)(logits, _kernel_metadata(temperature, seeds)).sampled_token_ids
    top_k = torch.zeros(17, dtype=torch.int32)
    top_k[16] = 5
    filtered = Sampler(use_triton=True)(logits, _kernel_metadata(temperature, seeds, top_k=top_k)).sampled_token_ids
    assert filtered[:16].tolist() == direct[:16].tolist()
    assert direct[4].item() == logits[4].float().argmax().item()
    assert filtered[16].item() in logits[16].float().topk(5).indices.tolist()


def test_a_threshold_draws_what_the_scaled_logits_masked_below_it_draw():
    """Rows with top-k / top-p reach the kernels as their logits, their temperature and a threshold
    on ``logits * (1 / T)``; a batch with min-p as scaled logits drawn at temperature 1. Both draw,
    seed for seed, what the scaled logits masked below the threshold draw, and top-p alone keeps a
    row's draw beside a top-k row."""
    torch.manual_seed(5)
    logits = (torch.randn(24, 300) * 2).to(torch.bfloat16)
    temperature = torch.rand(24) + 0.4
    temperature[7] = 0.0
    seeds = torch.arange(24, dtype=torch.int64) * 7919 + 11
    top_p = torch.rand(24) * 0.8 + 0.1
    scaled = logits.float() * torch.where(temperature > 0, 1 / temperature, 1.0).unsqueeze(-1)
    threshold = sampler_module.sorted_top_p_threshold(scaled, top_p)
    expected = sample(scaled.masked_fill(scaled < threshold, float("-inf")), (temperature > 0).float(), seeds)
    assert sample(logits, temperature, seeds, threshold).tolist() == expected.tolist()
    alone = SamplingMetadata(temperature, None, top_p, all_greedy=False, all_random=False, seeds=seeds,
                             top_p_without_top_k=True)
    assert Sampler(use_triton=True)(logits, alone).sampled_token_ids.tolist() == expected.tolist()
    top_k = torch.zeros(24, dtype=torch.int32)
    top_k[23] = 3
    beside_top_k = _kernel_metadata(temperature, seeds, top_k=top_k, top_p=torch.where(top_k > 0, 1.0, top_p))
    beside_top_k = SamplingMetadata(**{**beside_top_k.__dict__, "top_p_without_top_k": True})
    mixed = Sampler(use_triton=True)(logits, beside_top_k).sampled_token_ids
    assert mixed[:23].tolist() == expected[:23].tolist()
    with_min_p = Sampler(use_triton=True)(logits, replace(beside_top_k, min_p=torch.zeros(24))).sampled_token_ids
    assert with_min_p.tolist() == mixed.tolist()
    assert expected[7].item() == logits[7].float().argmax().item()


def test_fp32_logits_are_scaled_first_only_for_top_k():
    """fp32 logits (an fp32 model's, or the logits processors') reach the kernels as they are, with
    their temperature, unless a row has top-k, whose ties scaling could change: drawn either way,
    seed for seed, as the scaled logits masked below the threshold are."""
    torch.manual_seed(6)
    logits = torch.randn(12, 300) * 2
    temperature = torch.rand(12) + 0.4
    seeds = torch.arange(12, dtype=torch.int64) * 7919 + 3
    top_k, top_p = torch.full((12,), 40, dtype=torch.int32), torch.rand(12) * 0.8 + 0.1
    scaled = logits * (1 / temperature).unsqueeze(-1)
    cases = [  # metadata, the threshold on the scaled logits, whether the kernels get the logits as they are
        (_kernel_metadata(temperature, seeds), torch.full((12, 1), float("-inf")), True),
        (SamplingMetadata(temperature, None, top_p, all_greedy=False, all_random=True, seeds=seeds,
                          top_p_without_top_k=True), sampler_module.sorted_top_p_threshold(scaled, top_p), True),
        (_kernel_metadata(temperature, seeds, top_k=top_k, top_p=top_p),
         sampler_module.top_k_top_p_threshold(scaled, top_k, top_p, 64), False),
    ]
    sampler = Sampler(use_triton=True)
    given = []
    sampler.triton_sample = lambda scores, *args: given.append(scores) or sample(scores, *args)
    for metadata, threshold, as_they_are in cases:
        expected = sample(scaled.masked_fill(scaled < threshold, float("-inf")), torch.ones(12), seeds)
        assert sampler(logits, metadata).sampled_token_ids.tolist() == expected.tolist()
        assert (given[-1] is logits) == as_they_are


def test_filtered_rows_follow_the_truncated_softmax():
    """800 draws with top-k 4 over 12 tokens: never outside the top 4, and those follow their
    renormalised probabilities at temperature 0.7."""
    vocab, draws, temperature = 12, 800, 0.7
    row = torch.linspace(-4.0, 4.0, vocab)
    metadata = _kernel_metadata(torch.full((draws,), temperature), torch.arange(draws, dtype=torch.int64) * 7919,
                                top_k=torch.full((draws,), 4, dtype=torch.int32))
    counts = torch.bincount(Sampler(use_triton=True)(row.repeat(draws, 1), metadata).sampled_token_ids,
                            minlength=vocab).double()
    assert counts[:-4].sum() == 0
    assert_follows(counts, row, temperature, top_k=4)


def test_the_sampler_turns_row_seeds_into_what_its_route_draws_with():
    """The runner hands over each seeded row's seed: the Triton route gets a Philox seed for every row
    (the unseeded ones from the engine's stream), the PyTorch route a generator per seeded row; a
    greedy batch needs neither."""
    def metadata(greedy: bool = False) -> SamplingMetadata:
        return SamplingMetadata(torch.full((4,), 0.0 if greedy else 1.0), None, None, all_greedy=greedy,
                                all_random=not greedy)

    triton_route = Sampler(True, seed=7, max_num_reqs=4)
    drawn = triton_route.add_row_seeds(metadata(), {1: 123, 3: 456})
    stream = np.random.default_rng(7).integers(0, 2**63 - 1, 4).tolist()
    assert drawn.seeds.tolist() == [stream[0], 123, stream[2], 456] and not drawn.generators
    greedy = triton_route.add_row_seeds(metadata(greedy=True), {})
    assert greedy.seeds is None
    torch_route = Sampler(False, seed=7)
    drawn = torch_route.add_row_seeds(metadata(), {1: 123})
    assert drawn.seeds is None and list(drawn.generators) == [1] and drawn.generators[1].initial_seed() == 123


def test_the_triton_route_draws_the_engine_stream_in_order_across_its_bulk_draws(monkeypatch):
    """Seeds drawn ahead in bulk are the ones a draw of each step's rows at a time would give, also
    where a step's rows straddle two bulk draws."""
    monkeypatch.setattr(sampler_module, "SEED_POOL_SIZE", 5)
    sampler = Sampler(True, seed=3, max_num_reqs=8)
    stream = np.random.default_rng(3)
    for n in [4, 3, 8, 1, 6, 8, 2]:
        drawn = sampler.add_row_seeds(SamplingMetadata(torch.ones(n), None, None, all_greedy=False, all_random=True),
                                      {})
        assert drawn.seeds.tolist() == stream.integers(0, 2**63 - 1, n).tolist()


def test_the_runner_path_keeps_seeded_requests_independent_of_the_batch(tmp_path):
    """Through LLM with the kernel path forced on CPU: a seeded request draws the same tokens alone
    and in a crowd, greedy rows stay greedy beside sampled ones, and the engine seed fixes the rest."""
    from micro_vllm import LLM, SamplingParams
    from helpers.tiny_models import make_tiny_model

    path = make_tiny_model("qwen3", tmp_path)
    prompts = [[5, 6, 7, 8], [9] * 11, [3, 1, 4, 1, 5, 9, 2, 6], [42]]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.8, seed=1234, ignore_eos=True)  # the top-p search
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=10, temperature=0.8, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(model=str(path), device="cpu", max_model_len=64, max_num_seqs=4, custom_ops=["+sampler"]) as llm:
            alone = llm.generate([prompts[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
            greedy_alone = llm.generate([prompts[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
            crowd = llm.generate(prompts, [greedy, unseeded, seeded, unseeded], use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in crowd])
        assert crowd[2].outputs[0].token_ids == alone
        assert crowd[0].outputs[0].token_ids == greedy_alone
    assert runs[0] == runs[1]  # the engine seed (0) fixes the unseeded rows too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestOnGpu:
    def test_real_shapes_greedy_and_batch_independence(self):
        """The benchmark's shape: 256 rows of bf16 logits over 151,936 tokens."""
        logits = torch.randn(256, 151936, device="cuda").to(torch.bfloat16)
        seeds = torch.randint(0, 2**62, (256,), device="cuda")
        greedy = sample(logits, torch.zeros(256, device="cuda"), seeds)
        assert greedy.tolist() == logits.float().argmax(dim=-1).tolist()
        temperature = torch.full((256,), 0.6, device="cuda")
        tokens = sample(logits, temperature, seeds)
        assert sample(logits[100:101], temperature[:1], seeds[100:101]).item() == tokens[100].item()

    def test_random_rows_follow_the_softmax(self):
        vocab, draws, temperature = 12, 200_000, 0.7
        row = torch.linspace(-2.0, 1.5, vocab, device="cuda")
        seeds = torch.randint(0, 2**62, (draws,), device="cuda")
        tokens = sample(row.repeat(draws, 1), torch.full((draws,), temperature, device="cuda"), seeds)
        assert_follows(torch.bincount(tokens, minlength=vocab).double().cpu(), row.cpu(), temperature)

    def test_random_rows_follow_the_softmax_across_chunks(self):
        """The same 12 tokens 1,000 apart in a vocabulary of 12,000 (six chunks), the rest -inf: the
        chunk step at the real chunk size."""
        vocab, spacing, draws, temperature = 12, 1000, 50_000, 0.7
        row = torch.linspace(-2.0, 1.5, vocab, device="cuda")
        logits = torch.full((draws, vocab * spacing), float("-inf"), device="cuda")
        logits[:, ::spacing] = row
        seeds = torch.randint(0, 2**62, (draws,), device="cuda")
        tokens = sample(logits, torch.full((draws,), temperature, device="cuda"), seeds)
        assert (tokens % spacing == 0).all()
        assert_follows(torch.bincount(tokens // spacing, minlength=vocab).double().cpu(), row.cpu(), temperature)
