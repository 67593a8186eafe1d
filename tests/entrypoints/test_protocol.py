"""``to_sampling_params``: OpenAI's defaults, vLLM's cap on max_tokens, and every field mapped to
its SamplingParams field (no server needed)."""

import pytest

from micro_vllm import RequestOutputKind
from micro_vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params

MESSAGES = [{"role": "user", "content": "hi"}]


def test_defaults_and_the_max_tokens_rules():
    params = to_sampling_params(CompletionRequest(prompt="x"), room=100)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)  # OpenAI's
    assert params.output_kind is RequestOutputKind.DELTA
    assert to_sampling_params(CompletionRequest(prompt="x", max_tokens=500), room=100).max_tokens == 100
    assert to_sampling_params(ChatCompletionRequest(messages=MESSAGES), room=77).max_tokens == 77  # what is left
    chat = ChatCompletionRequest(messages=MESSAGES, max_tokens=5, max_completion_tokens=9)
    assert to_sampling_params(chat, room=77).max_tokens == 9  # the newer name wins


def test_fields_map_to_their_sampling_params():
    request = CompletionRequest(prompt="x", temperature=0, top_p=0.5, top_k=3, seed=4, stop="\n", ignore_eos=True,
                                stop_token_ids=[7], include_stop_str_in_output=True, skip_special_tokens=False)
    params = to_sampling_params(request, room=50)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0, 0.5, 3, 4)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (("\n",), (7,), True)
    assert params.include_stop_str_in_output and not params.skip_special_tokens


def test_vllm_sampling_fields_map_to_their_sampling_params():
    request = CompletionRequest(prompt="x", n=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                                min_p=0.1, min_tokens=2, logit_bias={"5": 1.0}, logprobs=2, allowed_token_ids=[5, 6],
                                bad_words=["no"])
    params = to_sampling_params(request, room=50)
    assert (params.n, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (3, 0.5, -0.5, 1.1)
    assert (params.min_p, params.min_tokens, params.logit_bias, params.logprobs) == (0.1, 2, {5: 1.0}, 2)
    assert (params.allowed_token_ids, params.bad_words) == ((5, 6), ("no",))
    chat = ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=3)
    assert to_sampling_params(chat, room=50).logprobs == 3
    assert to_sampling_params(ChatCompletionRequest(messages=MESSAGES, top_logprobs=3), room=50).logprobs is None


def test_response_format_and_structured_outputs():
    assert to_sampling_params(CompletionRequest(prompt="x", response_format={"type": "text"}), room=50)
    request = CompletionRequest(prompt="x", response_format={"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": {}}})
    assert to_sampling_params(request, room=50).structured_outputs.json == {}
    json_object = CompletionRequest(prompt="x", response_format={"type": "json_object"})
    assert to_sampling_params(json_object, room=50).structured_outputs.json_object
    regex = CompletionRequest(prompt="x", structured_outputs={"regex": "[0-9]+"})
    assert to_sampling_params(regex, room=50).structured_outputs.regex == "[0-9]+"
    with pytest.raises(ValueError, match="structured_outputs=.* is not allowed; give one of json"):
        to_sampling_params(CompletionRequest(prompt="x", structured_outputs={"jsn": {}}), room=50)
    with pytest.raises(ValueError, match="not allowed together"):
        to_sampling_params(CompletionRequest(prompt="x", structured_outputs={"regex": "a"},
                                             response_format={"type": "json_object"}), room=50)


def test_logit_bias_is_clamped_to_openais_range_and_nan_refused():
    params = to_sampling_params(CompletionRequest(prompt="x", logit_bias={"5": 150.0, "6": -1e9, "7": -3.5}), room=50)
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: -3.5}
    with pytest.raises(ValueError, match="logit_bias="):
        to_sampling_params(CompletionRequest(prompt="x", logit_bias={"5": float("nan")}), room=50)


def test_bad_values_are_refused_by_sampling_params():
    with pytest.raises(ValueError, match="top_p=2.0 is not allowed"):
        to_sampling_params(CompletionRequest(prompt="x", top_p=2), room=50)
    with pytest.raises(ValueError, match="logit_bias=.*keys must be token ids"):
        to_sampling_params(CompletionRequest(prompt="x", logit_bias={"a": 1.0}), room=50)
