"""vLLM's logits processors (penalties, bad words, min_tokens, logit_bias, allowed_token_ids, min_p)
against transformers' processors and plain PyTorch references, token by token through the engine
(greedy, so every processed logit row must pick the reference's token), under async and synchronous
scheduling, across preemption; and min-p on both sampler routes."""

import dataclasses

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from helpers import fault_workload
from helpers.fault_workload import model_dir  # noqa: F401
from helpers.core_helpers import token_ids
from helpers.tiny_models import one_torch_thread  # noqa: F401
from helpers.tiny_models import BOS_TOKEN_ID, EOS_TOKEN_ID, load_hf_reference, make_tiny_model
from micro_vllm import LLM, SamplingParams
from micro_vllm.sampling.logits_processors import LogitsProcessorsMetadata, TokenBiases, apply_min_p
from micro_vllm.sampling.params import bad_words_token_ids
from micro_vllm.sampling.sampler import Sampler, SamplingMetadata

MAX_TOKENS = 10


@torch.no_grad()
def reference_greedy(model, prompt: list[int], params: SamplingParams, process) -> list[int]:
    """transformers' model with full recomputation; each step takes the argmax of
    ``process(prompt, output, logits)`` and stops at EOS, a stop token id or max_tokens."""
    output: list[int] = []
    stop_ids = {EOS_TOKEN_ID, *params.stop_token_ids}
    while len(output) < params.max_tokens:
        logits = model(torch.tensor([prompt + output])).logits[0, -1:].float()
        token = int(process(prompt, output, logits)[0].argmax())
        output.append(token)
        if token in stop_ids:
            break
    return output


def hf(processor, with_prompt: bool = True):
    """A transformers processor as a ``process``: it sees the prompt and the output, or (for bad
    words, which vLLM matches on the output only) the output after a token of no bad word."""
    def process(prompt, output, logits):
        ids = (prompt if with_prompt else [BOS_TOKEN_ID]) + output
        return processor(torch.tensor([ids]), logits)
    return process


def chain(*processes):
    def process(prompt, output, logits):
        for p in processes:
            logits = p(prompt, output, logits)
        return logits
    return process


def presence_frequency(presence: float, frequency: float):
    def process(prompt, output, logits):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1]).float()
        return logits - frequency * counts - presence * (counts > 0).float()
    return process


def bias(token_biases: dict[int, float]):
    def process(prompt, output, logits):
        logits = logits.clone()
        for token_id, value in token_biases.items():
            logits[0, token_id] += value
        return logits
    return process


def allowed(token_ids: list[int]):
    def process(prompt, output, logits):
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[0, token_ids] = True
        return logits.masked_fill(~keep, float("-inf"))
    return process


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **kwargs)


REPEATS = [(i * 37) % 250 for i in range(11)]  # the tiny llama repeats one token after it
K_PAREN_U = [40, 41, 42, 43, 44, 45]  # its greedy output holds "K)UU" and "PU"
ONE_O_AT = [116, 104, 101, 32]  # its greedy output holds "1" and "O@"
STOP = 70
# (prompt, params, reference): each request is run in one batch with all the others.
CASES = {
    # It finishes first, so that the last row (which the penalties decide) moves into its row.
    "plain": (REPEATS, SamplingParams(max_tokens=3, temperature=0), lambda p, o, logits: logits),
    "repetition": (REPEATS, greedy(repetition_penalty=1.8), hf(RepetitionPenaltyLogitsProcessor(1.8))),
    "repetition<1": (K_PAREN_U, greedy(repetition_penalty=0.5), hf(RepetitionPenaltyLogitsProcessor(0.5))),
    "all penalties": (K_PAREN_U, greedy(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.0),
                      chain(hf(RepetitionPenaltyLogitsProcessor(1.3)), presence_frequency(-0.5, 1.0))),
    "logit_bias": (ONE_O_AT, greedy(logit_bias={97: 6.0, 49: -50.0}), bias({97: 6.0, 49: -50.0})),
    "allowed_token_ids": (K_PAREN_U, greedy(allowed_token_ids=[85, 80, 41, 3, 200]), allowed([85, 80, 41, 3, 200])),
    "bad_words 3 and 2 tokens": (K_PAREN_U, greedy(bad_words=["K)U", "UU"]),
                                 hf(NoBadWordsLogitsProcessor([[75, 41, 85], [85, 85]]), with_prompt=False)),
    "bad_words 1 and 2 tokens": (ONE_O_AT, greedy(bad_words=["1", "O@"]),
                                 hf(NoBadWordsLogitsProcessor([[49], [79, 64]]), with_prompt=False)),
    "min_tokens": (  # without it, the biases end the request at its first token
        REPEATS, greedy(min_tokens=5, stop_token_ids=[STOP], logit_bias={EOS_TOKEN_ID: 50.0, STOP: 60.0}),
        chain(bias({EOS_TOKEN_ID: 50.0, STOP: 60.0}),
              lambda p, o, logits: MinNewTokensLengthLogitsProcessor(len(p), 5, [EOS_TOKEN_ID, STOP])(
                  torch.tensor([p + o]), logits)),
    ),
    "everything": (ONE_O_AT, greedy(repetition_penalty=1.2, frequency_penalty=0.3, bad_words=["O@"], min_tokens=3,
                                     logit_bias={EOS_TOKEN_ID: 4.0}, allowed_token_ids=list(range(40, 120)) + [257]),
                   chain(allowed(list(range(40, 120)) + [257]),
                         hf(NoBadWordsLogitsProcessor([[79, 64]]), with_prompt=False),
                         lambda p, o, logits: MinNewTokensLengthLogitsProcessor(len(p), 3, [EOS_TOKEN_ID])(
                             torch.tensor([p + o]), logits),
                         bias({EOS_TOKEN_ID: 4.0}), hf(RepetitionPenaltyLogitsProcessor(1.2)),
                         presence_frequency(0.0, 0.3))),
    "presence+frequency": (REPEATS, greedy(presence_penalty=1.5, frequency_penalty=0.6),
                           presence_frequency(1.5, 0.6)),
}


def test_bad_words_are_split_alone_and_after_a_space():
    """vLLM's rule: the spaced form counts when its first token differs and its length does not."""
    class Tokenizer:
        encode = staticmethod(lambda text, add_special_tokens: {
            "hello": [5, 6], " hello": [7, 6], "a b": [1, 2, 3], " a b": [9, 2, 3, 4], "x": [8], " x": [8],
            "": [],
        }[text])

    assert bad_words_token_ids(["hello", "  a b", "x"], Tokenizer()) == ((5, 6), (7, 6), (1, 2, 3), (8,))
    with pytest.raises(ValueError, match=r"bad_words contain '' \(after its leading spaces\)"):
        bad_words_token_ids([""], Tokenizer())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def hf_model(llama):
    return load_hf_reference(llama)


@pytest.fixture(scope="module")
def references(hf_model):
    return {name: reference_greedy(hf_model, prompt, params, process)
            for name, (prompt, params, process) in CASES.items()}


def test_each_case_changes_the_output(hf_model, references):
    """Each processor changes what plain greedy decoding of its prompt gives, so that the comparison
    below can fail; min_tokens holds back the stop tokens exactly until its count."""
    for name, (prompt, params, _) in CASES.items():
        if name != "plain":
            assert references[name] != reference_greedy(hf_model, prompt, greedy(), CASES["plain"][2]), name
    assert len(references["plain"]) == 3
    assert references["min_tokens"][5:] == [STOP]


@pytest.mark.parametrize("async_scheduling, custom_ops", [(True, None), (False, None), (True, ["+sampler"])],
                         ids=["async", "sync", "async-triton"])
def test_greedy_tokens_match_the_reference_processors(llama, references, async_scheduling, custom_ops):
    """On both sampler routes: the Triton route penalizes in its own pass (``triton_penalties``)."""
    names = list(CASES)
    with LLM(model=str(llama), device="cpu", dtype="float32", max_model_len=64, block_size=8,
             max_num_batched_tokens=32, max_num_seqs=len(names), async_scheduling=async_scheduling,
             custom_ops=custom_ops) as llm:
        outputs = llm.generate([CASES[n][0] for n in names], [CASES[n][1] for n in names], use_tqdm=False)
    assert dict(zip(names, token_ids(outputs))) == references


# -- async scheduling and preemption ---------------------------------------------------------------

PREEMPT_PARAMS = [
    greedy(repetition_penalty=1.5, frequency_penalty=0.5, ignore_eos=True),
    greedy(bad_words=["\x11\r"], ignore_eos=True),  # its plain output starts 247, 17, 13
    greedy(ignore_eos=True),
    greedy(repetition_penalty=0.8, presence_penalty=-0.4, ignore_eos=True),
    greedy(frequency_penalty=2.0, ignore_eos=True),
]
PREEMPT_REFERENCES = [
    chain(hf(RepetitionPenaltyLogitsProcessor(1.5)), presence_frequency(0, 0.5)),
    hf(NoBadWordsLogitsProcessor([[17, 13]]), with_prompt=False),
    lambda p, o, logits: logits,
    chain(hf(RepetitionPenaltyLogitsProcessor(0.8)), presence_frequency(-0.4, 0)),
    presence_frequency(0, 2.0),
]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_penalties_survive_preemption(async_scheduling, model_dir):
    """The fault workload's cache is small enough that requests preempt each other; a preempted
    request's token counts are rebuilt when it comes back, and rows that move keep theirs."""
    with fault_workload.make_llm(model_dir, async_scheduling=async_scheduling) as llm:
        preempted = fault_workload.record_preemptions(llm)
        outputs = llm.generate(fault_workload.PROMPTS, PREEMPT_PARAMS, use_tqdm=False)
    assert preempted
    model = load_hf_reference(model_dir)
    expected = [reference_greedy(model, list(prompt), params, process)
                for prompt, params, process in zip(fault_workload.PROMPTS, PREEMPT_PARAMS, PREEMPT_REFERENCES)]
    assert token_ids(outputs) == expected
    assert expected[1][:2] == [247, 17] and expected[1][2] != 13  # the bad word was hit


# -- seeded sampling -------------------------------------------------------------------------------

SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, logit_bias={85: 6.0}, repetition_penalty=1.5,
                        frequency_penalty=1.0, min_p=0.02, bad_words=["W"], ignore_eos=True)
OTHERS = [greedy(presence_penalty=1.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=1.0, seed=3, top_k=20, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=1.2, frequency_penalty=-1.0, min_tokens=8)]


@pytest.fixture(scope="module")
def llm(llama):
    with LLM(model=str(llama), device="cpu", dtype="float32", max_model_len=64, block_size=8,
             max_num_batched_tokens=32) as llm:
        yield llm


def test_seeded_sampling_with_processors_does_not_depend_on_the_batch(llm):
    alone = token_ids(llm.generate([K_PAREN_U], SEEDED, use_tqdm=False))[0]
    first = token_ids(llm.generate([REPEATS, K_PAREN_U, ONE_O_AT], [OTHERS[0], SEEDED, OTHERS[1]], use_tqdm=False))
    last = token_ids(llm.generate([ONE_O_AT, REPEATS, K_PAREN_U], [OTHERS[2], OTHERS[0], SEEDED], use_tqdm=False))
    assert first[1] == last[2] == alone
    # The bias alone repeats its token; the penalties make it rarer, so they count the outputs.
    biased_only = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, logit_bias={85: 6.0}, ignore_eos=True)
    without_penalties = token_ids(llm.generate([K_PAREN_U], biased_only, use_tqdm=False))[0]
    assert 1 < alone.count(85) < without_penalties.count(85)


def test_min_p_of_one_samples_the_greedy_tokens(llm):
    """At temperature 1 only the most likely token has at least its own probability."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, min_p=1.0, seed=seed) for seed in (1, 2)]
    outputs = token_ids(llm.generate([K_PAREN_U, REPEATS], params, use_tqdm=False))
    assert outputs == token_ids(llm.generate([K_PAREN_U, REPEATS], greedy(), use_tqdm=False))


# -- min-p and the two sampler routes --------------------------------------------------------------


def test_min_p_keeps_what_transformers_keeps():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.3])
    min_p = torch.tensor([0.05, 0.3, 0.0, 1.0, 0.01])
    kept = apply_min_p(logits / temperature.unsqueeze(-1), min_p).isfinite()
    for row in range(len(logits)):
        scaled = TemperatureLogitsWarper(temperature[row].item())(None, logits[row : row + 1])
        expected = MinPLogitsWarper(min_p[row].item())(None, scaled).isfinite()[0]
        assert torch.equal(kept[row], expected), row
    assert 1 < kept[0].sum() < kept[4].sum() < 300 and kept[2].all() and kept[3].sum() == 1


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("with_min_p", [False, True], ids=["unfiltered", "min_p"])
def test_both_sampler_routes_draw_from_the_processed_logits(use_triton, with_min_p):
    """Greedy rows take the argmax of the processed logits; random rows draw only tokens that the
    processors and min-p leave (rows 4-7 restricted to a few tokens, every row's favourite banned)."""
    torch.manual_seed(2)
    num_rows, vocab = 12, 300
    logits = torch.randn(num_rows, vocab) * 2
    temperature = torch.tensor([0.0] * 2 + [1.0] * 10)
    min_p = torch.tensor([0.0] * 8 + [0.3 if with_min_p else 0.0] * 4)
    allowed_rows = torch.arange(4, 8)
    allowed_ids = torch.tensor([3, 50, 51, 299])
    processors = LogitsProcessorsMetadata(
        allowed_rows=allowed_rows,
        allowed_token_ids=(allowed_rows.repeat_interleave(4), allowed_ids.repeat(4)),
        bans=TokenBiases(torch.arange(num_rows), logits.argmax(dim=-1), torch.full((num_rows,), -float("inf"))),
    )
    sampler = Sampler(use_triton, seed=0, max_num_reqs=num_rows)
    metadata = SamplingMetadata(temperature, None, None, all_greedy=False, all_random=False,
                                min_p=min_p if with_min_p else None, logits_processors=processors)
    metadata = sampler.add_row_seeds(metadata, {})
    tokens = sampler(logits, metadata).sampled_token_ids

    processed = logits.clone()
    processed[4:8] = float("-inf")
    processed[4:8, allowed_ids] = logits[4:8, allowed_ids]
    processed[torch.arange(num_rows), logits.argmax(dim=-1)] = float("-inf")
    kept = apply_min_p(processed, min_p).isfinite()
    assert tokens[:2].tolist() == processed[:2].argmax(dim=-1).tolist()
    assert kept[torch.arange(num_rows), tokens].all()
    assert set(tokens[4:8].tolist()) <= set(allowed_ids.tolist())


def test_min_tokens_hold_back_stop_strings_in_the_engine(llm, hf_model):
    """K_PAREN_U's greedy output has "U" as its 5th and 6th tokens: the stop string ends the request
    at the 5th, or with min_tokens=5 at the 6th."""
    plain = reference_greedy(hf_model, K_PAREN_U, greedy(), CASES["plain"][2])
    assert plain[4:6] == [85, 85] and 85 not in plain[:4]
    outputs = llm.generate([K_PAREN_U] * 2, [greedy(stop="U"), greedy(stop="U", min_tokens=5)], use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in outputs] == [(plain[:5], "U"), (plain[:6], "U")]


def test_each_sequence_of_an_n_request_applies_the_processors(llm):
    """Sequence i of a seeded n-request is its prompt alone with seed + i, bad words included (each
    child request carries the parent's tokenized bad words)."""
    params = dataclasses.replace(SEEDED, n=3, bad_words=["U"])
    [output] = llm.generate([K_PAREN_U], params, use_tqdm=False)
    for completion in output.outputs:
        alone = dataclasses.replace(params, n=1, seed=params.seed + completion.index)
        assert completion.token_ids == token_ids(llm.generate([K_PAREN_U], alone, use_tqdm=False))[0]
