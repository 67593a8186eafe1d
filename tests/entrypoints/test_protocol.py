"""``to_sampling_params``: OpenAI's defaults, vLLM's rules for max_tokens, and every field mapped to
its SamplingParams field; a completion or chat stream's chunk written as its model (no server needed)."""

import pytest
from pydantic import ValidationError

from micro_vllm import RequestOutputKind
from micro_vllm.engine.request_output import CompletionOutput
from micro_vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    OpenAIError,
    UsageInfo,
    request_field,
    to_sampling_params,
)
from micro_vllm.entrypoints.openai.serving import (
    OpenAIServing,
    PreparedRequest,
    _chat_role_chunk,
    _ChatDeltas,
    _sse,
    _stream_chunk,
)
from micro_vllm.entrypoints.openai.tool_parsers import ToolParserManager
from micro_vllm.logprobs import Logprob

MESSAGES = [{"role": "user", "content": "hi"}]


def sampling_params(request, room=50):
    """The params for a prompt of 10 tokens that leaves ``room`` under max_model_len."""
    return to_sampling_params(request, 10, 10 + room)


def test_defaults_and_the_max_tokens_rules():
    params = sampling_params(CompletionRequest(prompt="x"), room=100)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)  # OpenAI's
    assert params.output_kind is RequestOutputKind.DELTA
    assert sampling_params(CompletionRequest(prompt="x", max_tokens=None), room=100).max_tokens == 100
    assert sampling_params(ChatCompletionRequest(messages=MESSAGES), room=77).max_tokens == 77  # what is left
    chat = ChatCompletionRequest(messages=MESSAGES, max_tokens=5, max_completion_tokens=9)
    assert sampling_params(chat, room=77).max_tokens == 9  # the newer name wins
    assert sampling_params(CompletionRequest(prompt="x", max_tokens=100), room=100).max_tokens == 100


@pytest.mark.parametrize("request_, param, message", [
    (CompletionRequest(prompt="x", max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0."),
    (ChatCompletionRequest(messages=MESSAGES, max_tokens=0), "max_tokens", "max_tokens must be at least 1"),
    (ChatCompletionRequest(messages=MESSAGES, max_completion_tokens=0), "max_completion_tokens",
     "max_completion_tokens must be at least 1, got 0."),
    (ChatCompletionRequest(messages=MESSAGES, max_tokens=3, max_completion_tokens=-1), "max_completion_tokens",
     "got -1"),
    (CompletionRequest(prompt="x", max_tokens=2**63), "max_tokens",
     f"'max_tokens' or 'max_completion_tokens' is too large: {2**63}. This model's maximum context length is 60 "
     f"tokens and your request has 10 input tokens ({2**63} > 60 - 10)."),
    (ChatCompletionRequest(messages=MESSAGES, max_completion_tokens=51), "max_completion_tokens", "too large: 51"),
    (CompletionRequest(prompt="x", stream_options={"include_usage": True}), "stream_options",
     "Stream options can only be defined when `stream=True`."),
    (ChatCompletionRequest(messages=MESSAGES, top_logprobs=2), "top_logprobs",
     "when using `top_logprobs`, `logprobs` must be set to true."),
    (ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=-2), "top_logprobs", "positive value"),
    (CompletionRequest(prompt="x", response_format={"type": "json_schema"}), "response_format",
     "the 'json_schema' field must be provided"),
    (CompletionRequest(prompt="x", response_format={"type": "json_schema", "json_schema": {"schema": {"type": 7}}}),
     "response_format.json_schema.schema", "response_format.json_schema.schema={'type': 7} is not allowed"),
    (CompletionRequest(prompt="x", structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
     "structured_outputs", "not allowed together"),
    (CompletionRequest(prompt="x", structured_outputs={"jsn": {}}), "structured_outputs", "give one of json"),
    (CompletionRequest(prompt="x", structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs",
     "exactly one of"),
    (CompletionRequest(prompt="x", stream=True, prompt_logprobs=1), "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    (ChatCompletionRequest(messages=MESSAGES, stream=True, prompt_logprobs=-1), "prompt_logprobs", "not available"),
])
def test_vllms_refusals_name_the_field(request_, param, message):
    """What vLLM refuses, with vLLM's message where it has one, and the field the client wrote."""
    with pytest.raises(OpenAIError) as refused:
        sampling_params(request_)
    assert refused.value.param == param and message in str(refused.value)


def test_a_prompt_that_leaves_no_room_is_refused():
    with pytest.raises(OpenAIError, match="maximum context length is 10 tokens. However, your request has 10 "
                       "input tokens") as refused:
        to_sampling_params(ChatCompletionRequest(messages=MESSAGES), 10, 10)
    assert refused.value.param == "messages"


def test_chat_names_its_fields_as_the_client_wrote_them():
    chat = ChatCompletionRequest(messages=MESSAGES, max_completion_tokens=3)
    assert [request_field(chat, name) for name in ("logprobs", "max_tokens", "prompt_token_ids", "top_p")] == \
        ["top_logprobs", "max_completion_tokens", "messages", "top_p"]
    completion = CompletionRequest(prompt="x")
    assert [request_field(completion, name) for name in ("logprobs", "max_tokens", "prompt_token_ids")] == \
        ["logprobs", "max_tokens", "prompt"]


def test_token_ids_are_strict():
    """JSON's true and false are no token ids (pydantic would read them as 1 and 0)."""
    for body in ('{"prompt": [true, false]}', '{"prompt": "x", "stop_token_ids": [true]}',
                 '{"prompt": "x", "allowed_token_ids": [1.0]}'):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate_json(body)


def test_fields_map_to_their_sampling_params():
    request = CompletionRequest(prompt="x", temperature=0, top_p=0.5, top_k=3, seed=4, stop="\n", ignore_eos=True,
                                stop_token_ids=[7], include_stop_str_in_output=True, skip_special_tokens=False)
    params = sampling_params(request, room=50)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0, 0.5, 3, 4)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (("\n",), (7,), True)
    assert params.include_stop_str_in_output and not params.skip_special_tokens


def test_vllm_sampling_fields_map_to_their_sampling_params():
    request = CompletionRequest(prompt="x", n=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                                min_p=0.1, min_tokens=2, logit_bias={"5": 1.0}, logprobs=2, allowed_token_ids=[5, 6],
                                bad_words=["no"])
    params = sampling_params(request, room=50)
    assert (params.n, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (3, 0.5, -0.5, 1.1)
    assert (params.min_p, params.min_tokens, params.logit_bias, params.logprobs) == (0.1, 2, {5: 1.0}, 2)
    assert (params.allowed_token_ids, params.bad_words) == ((5, 6), ("no",))
    chat = ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=3)
    assert sampling_params(chat, room=50).logprobs == 3
    assert sampling_params(ChatCompletionRequest(messages=MESSAGES, top_logprobs=0), room=50).logprobs is None


def test_response_format_and_structured_outputs():
    assert sampling_params(CompletionRequest(prompt="x", response_format={"type": "text"}), room=50)
    request = CompletionRequest(prompt="x", response_format={"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": {}}})
    assert sampling_params(request, room=50).structured_outputs.json == {}
    json_object = CompletionRequest(prompt="x", response_format={"type": "json_object"})
    assert sampling_params(json_object, room=50).structured_outputs.json_object
    regex = CompletionRequest(prompt="x", structured_outputs={"regex": "[0-9]+"})
    assert sampling_params(regex, room=50).structured_outputs.regex == "[0-9]+"


def test_logit_bias_is_clamped_to_openais_range_and_nan_refused():
    params = sampling_params(CompletionRequest(prompt="x", logit_bias={"5": 150.0, "6": -1e9, "7": -3.5}), room=50)
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: -3.5}
    with pytest.raises(ValueError, match="logit_bias="):
        sampling_params(CompletionRequest(prompt="x", logit_bias={"5": float("nan")}), room=50)


def test_bad_values_are_refused_by_sampling_params():
    with pytest.raises(ValueError, match="top_p=2.0 is not allowed"):
        sampling_params(CompletionRequest(prompt="x", top_p=2), room=50)
    with pytest.raises(ValueError, match="logit_bias=.*keys must be token ids"):
        sampling_params(CompletionRequest(prompt="x", logit_bias={"a": 1.0}), room=50)


def test_echo_and_prompt_logprobs():
    """vLLM's rules: echo's prompt logprobs are as many as ``logprobs`` unless ``prompt_logprobs`` says;
    echo with ``max_tokens=0`` samples one token (that the response leaves out); ``prompt_logprobs=0``
    may stream."""
    echo = sampling_params(CompletionRequest(prompt="x", echo=True, logprobs=2))
    assert (echo.logprobs, echo.prompt_logprobs, echo.max_tokens) == (2, 2, 16)
    both = sampling_params(CompletionRequest(prompt="x", echo=True, logprobs=2, prompt_logprobs=4))
    assert (both.logprobs, both.prompt_logprobs) == (2, 4)
    assert sampling_params(CompletionRequest(prompt="x", echo=True)).prompt_logprobs is None
    assert sampling_params(CompletionRequest(prompt="x", echo=True, max_tokens=0)).max_tokens == 1
    chat = sampling_params(ChatCompletionRequest(messages=MESSAGES, prompt_logprobs=0, stream=True))
    assert (chat.prompt_logprobs, chat.logprobs) == (0, None)


@pytest.mark.parametrize("fields", [
    {},
    {"logprobs": 1, "return_token_ids": True, "echo": True, "stream_options": {"continuous_usage_stats": True,
                                                                             "include_usage": True}},
])
def test_a_completion_chunk_is_the_models_json(fields):
    """The stream's chunks are plain dicts (``_stream_chunk``), written byte for byte as the models."""
    serving = OpenAIServing.__new__(OpenAIServing)  # what makes a choice needs no engine
    serving.tokenizer = None
    request = CompletionRequest(prompt=[1, 2], max_tokens=3, stream=True, **fields)
    prepared = PreparedRequest(request, "pr\u00e9", [1, 2], to_sampling_params(request, 2, 10))
    logprobs = [{5: Logprob(-0.25, 1, "x"), 6: Logprob(float("-inf"), 2, "y")}]
    for first, finish_reason, stop_reason in ((True, None, None), (False, "stop", 7), (False, "length", "\u00e9!")):
        completion = CompletionOutput(0, "t\u00e9xt \u2028", [5], -0.25, logprobs, finish_reason, stop_reason)
        choice = serving._completion_choice(request, prepared, completion, 3, [None, None], first, 4)
        usage = UsageInfo(prompt_tokens=2, completion_tokens=1, total_tokens=3) if fields else None
        for choices in ([choice], []):
            model = CompletionResponse(id="cmpl-1", created=17, model="m", choices=choices, usage=usage)
            assert _sse(_stream_chunk(False, "cmpl-1", 17, "m", choices, usage)) == f"data: {model.model_dump_json()}\n\n"


@pytest.mark.parametrize("fields", [
    {},
    {"logprobs": True, "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True,
     "stream_options": {"continuous_usage_stats": True, "include_usage": True}},
    {"logprobs": True, "tools": [{"function": {"name": "f"}}], "tool_choice": "auto"},
])
def test_a_chat_chunk_is_the_models_json(fields):
    """A chat stream's chunks too, the role's first and the usage's last, and a tool parser's deltas."""
    serving = OpenAIServing.__new__(OpenAIServing)  # what makes a choice needs no engine
    serving.tokenizer = None
    parser = ToolParserManager.get_tool_parser("hermes") if "tools" in fields else None
    request = ChatCompletionRequest(messages=MESSAGES, max_tokens=3, stream=True, **fields)
    prepared = PreparedRequest(request, "pr\u00e9", [1, 2], to_sampling_params(request, 2, 10))
    usage = UsageInfo(prompt_tokens=2, completion_tokens=0, total_tokens=2)
    role = ChatCompletionStreamChoice(index=3, delta=DeltaMessage(role="assistant", content=""))
    expected = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=17, model="m", choices=[role], prompt_token_ids=[1, 2] if request.return_token_ids else None,
        usage=usage if "stream_options" in fields else None)
    assert _sse(_chat_role_chunk(request, prepared, 3, "chatcmpl-1", 17, "m")) == \
        f"data: {expected.model_dump_json()}\n\n"
    logprobs = [{5: Logprob(-0.25, 1, "x"), 6: Logprob(float("-inf"), 2, "y")}]
    deltas, streamed = _ChatDeltas(parser() if parser else None), ""
    for text, finish_reason, stop_reason in (("t\u00e9xt \u2028", None, None),
                                             ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, 7),
                                             ("</tool_call>", "stop", "\u00e9!")):
        completion = CompletionOutput(3, text, [5], -0.25, logprobs if fields else None, finish_reason, stop_reason)
        choice = serving._chat_stream_choice(request, completion, deltas)
        for choices in ([choice], []):
            model = ChatCompletionStreamResponse(id="chatcmpl-1", created=17, model="m", choices=choices, usage=usage)
            chunk = _stream_chunk(True, "chatcmpl-1", 17, "m", choices, usage)
            assert _sse(chunk) == f"data: {model.model_dump_json()}\n\n"
            streamed += _sse(chunk)
    assert ('"tool_calls":[{"index":0' in streamed) == (parser is not None)  # the parser's deltas were there
