"""Outputs in vLLM's shape on the default model: stop strings end a request where its text first
contains one (also across token boundaries), the text is cut as vLLM cuts it, ``stop_reason`` says
what ended it; streamed DELTA outputs add up to the final text, CUMULATIVE ones only grow."""

from pathlib import Path

import pytest

from micro_vllm import LLM, RequestOutputKind, SamplingParams
from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path

pytestmark = pytest.mark.real_model

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 10
STREAMED_STOP = " return"  # the greedy answer has it; deltas must hold back what could start it


@pytest.fixture(scope="module")
def llm():
    try:
        model_dir: Path = default_model_path()
    except DefaultModelUnavailable as e:  # no PyPI access, or gguf/accelerate missing
        pytest.skip(f"default model unavailable: {e}")
    # sdpa: the Triton backend runs interpreted on CPU, and attention is not what these tests check.
    with LLM(model=str(model_dir), device="cpu", max_model_len=128, attention_backend="sdpa") as llm:
        yield llm


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **kwargs)


@pytest.fixture(scope="module")
def streamed(llm):
    """Every output ``Engine.step`` gives, per request, for one greedy prompt in each output kind
    (and a DELTA one with a stop string), run in one batch."""
    engine = llm.engine
    kinds = {
        "final": greedy(output_kind=RequestOutputKind.FINAL_ONLY),
        "delta": greedy(output_kind=RequestOutputKind.DELTA),
        "cumulative": greedy(output_kind=RequestOutputKind.CUMULATIVE),
        "delta_stop": greedy(output_kind=RequestOutputKind.DELTA, stop=STREAMED_STOP),
    }
    for name, params in kinds.items():
        engine.add_request(name, PROMPT, params)
    outputs = {name: [] for name in kinds}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def test_final_only_gives_one_finished_output(streamed):
    [final] = streamed["final"]
    completion = final.outputs[0]
    assert final.finished and completion.finish_reason == "length" and completion.stop_reason is None
    assert len(completion.token_ids) == MAX_TOKENS and completion.text
    assert final.prompt == PROMPT and final.prompt_logprobs is None and completion.index == 0


def test_deltas_add_up_to_the_final_output(streamed):
    final = streamed["final"][0].outputs[0]
    deltas = streamed["delta"]
    assert len(deltas) == MAX_TOKENS  # one per step that gave the request a token
    assert [d.finished for d in deltas] == [False] * (MAX_TOKENS - 1) + [True]
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_cumulative_outputs_only_grow(streamed):
    final = streamed["final"][0].outputs[0]
    outputs = [o.outputs[0] for o in streamed["cumulative"]]
    assert len(outputs) == MAX_TOKENS
    for before, after in zip(outputs, outputs[1:]):
        assert after.text.startswith(before.text) and after.token_ids[:-1] == before.token_ids
    assert (outputs[-1].text, outputs[-1].token_ids) == (final.text, final.token_ids)
    assert [o.finish_reason for o in outputs] == [None] * (MAX_TOKENS - 1) + ["length"]


def test_deltas_hold_back_what_could_start_a_stop_string(streamed):
    final_text = streamed["final"][0].outputs[0].text
    deltas = streamed["delta_stop"]
    assert STREAMED_STOP in final_text
    assert "".join(d.outputs[0].text for d in deltas) == final_text[: final_text.index(STREAMED_STOP)]
    last = deltas[-1].outputs[0]
    assert deltas[-1].finished and (last.finish_reason, last.stop_reason) == ("stop", STREAMED_STOP)


def test_stop_strings_through_generate(llm, streamed):
    final = streamed["final"][0].outputs[0]
    text, tokens = final.text, final.token_ids
    tokenizer = llm.tokenizer
    # The text's length after each token (ASCII here, so every prefix decodes whole).
    ends = [len(tokenizer.decode(tokens[:i])) for i in range(1, len(tokens) + 1)]
    assert ends[-1] == len(text)

    def tokens_until(end: int) -> list[int]:
        """The tokens up to the one whose text reaches ``end``: where a stop string ending there stops."""
        return tokens[: next(i for i, e in enumerate(ends) if e >= end) + 1]

    # A stop string of 2 + 2 characters around a token boundary, first found there.
    boundary = next(e for e in ends[1:] if text.find(text[e - 2:e + 2]) == e - 2 and e + 2 <= len(text))
    crossing = text[boundary - 2:boundary + 2]
    early, late = text[1:3], text[boundary:boundary + 3]
    assert text.find(early) == 1 and text.find(late) + 3 > 3  # "early" ends first, though listed last
    stop_token = tokens[5]
    cases = {
        "crossing": greedy(stop=crossing),
        "included": greedy(stop=[crossing], include_stop_str_in_output=True),
        "several": greedy(stop=[late, early]),
        "first token": greedy(stop=text[0]),
        "stop token": greedy(stop_token_ids=[stop_token]),
        "stop token included": greedy(stop_token_ids=[stop_token], include_stop_str_in_output=True),
    }
    outputs = dict(zip(cases, (o.outputs[0] for o in llm.generate([PROMPT] * len(cases), list(cases.values()),
                                                                   use_tqdm=False))))
    expected = {
        "crossing": (text[:boundary - 2], tokens_until(boundary + 2), crossing),
        "included": (text[:boundary + 2], tokens_until(boundary + 2), crossing),
        "several": (text[:1], tokens_until(3), early),
        "first token": ("", tokens[:1], text[0]),
        "stop token": (tokenizer.decode(tokens[:tokens.index(stop_token)]), tokens[:tokens.index(stop_token) + 1],
                       stop_token),
        "stop token included": (tokenizer.decode(tokens[:tokens.index(stop_token) + 1]),
                                tokens[:tokens.index(stop_token) + 1], stop_token),
    }
    for name, (want_text, want_tokens, want_reason) in expected.items():
        output = outputs[name]
        assert (output.text, output.token_ids, output.finish_reason, output.stop_reason) == (
            want_text, want_tokens, "stop", want_reason), name
