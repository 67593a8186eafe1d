"""Tool calling through a real ``micro-vllm serve --enable-auto-tool-choice --tool-call-parser hermes``
on a tiny random model, driven with the official ``openai`` client.

A random model calls no tool by itself, so its output is shaped: a named ``tool_choice`` and
``"required"`` are forced by the server's own JSON schema of the tools (what is tested is that the
calls come back well-formed, valid against the tool's parameters, whole and streamed alike); for
``"auto"``, the request's ``structured_outputs`` regex makes the model write a Hermes tool call, or
plain text, so that what is tested is the server's side: the parser reads the output into
``tool_calls`` and content, in a whole response and in a stream. Whitespace (and, where the model
chooses between going on and ending a list, a comma) is biased away so that the greedy random model
writes compact JSON and stops. The chat template renders the tools and the history's tool calls, so
the prompt's length (one token a byte) shows what reached it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from helpers.server import TINY_CHAT_SERVER

MODEL = TINY_CHAT_SERVER.served_model_name

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
COMPACT = {str(ord(c)): -100 for c in " \n\t\r"}  # the tiny tokenizer's token id is the byte
ONE_ITEM = {**COMPACT, str(ord(",")): -100}
HERMES_CALL = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
               r"</tool_call>")


@pytest.fixture(scope="module")
def model_path(tiny_chat_model):
    return tiny_chat_model


@pytest.fixture(scope="module")
def client(tiny_chat_server):
    """The server test_server.py, test_server_vllm_fields.py and test_bad_requests.py share
    (tests/entrypoints/conftest.py), started with the hermes tool parser; its chat template is
    ``helpers.server.TINY_CHAT_TEMPLATE``."""
    return openai.OpenAI(base_url=f"{tiny_chat_server.url}/v1", api_key=TINY_CHAT_SERVER.api_key, max_retries=0)


def chat(client, **kwargs):
    kwargs = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 120, **kwargs}
    return client.chat.completions.create(**kwargs)


def gathered(chunks) -> tuple[str, list[dict], str]:
    """A stream's content, its tool calls put together from their pieces (and how many pieces each
    came in), and its finish reason."""
    content, calls, finish_reason = "", [], None
    for chunk in chunks:
        [choice] = chunk.choices
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index == len(calls):
                assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": "", "pieces": 0})
            else:
                assert piece.index == len(calls) - 1 and piece.id is None and not piece.function.name
            calls[-1]["arguments"] += piece.function.arguments or ""
            calls[-1]["pieces"] += 1
        finish_reason = choice.finish_reason or finish_reason
    return content, calls, finish_reason


def calls_of(message) -> list[dict]:
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]


def check_whole_and_streamed(client, content: str | None, **kwargs) -> list[dict]:
    """The whole response has ``content`` and tool calls, finished for "tool_calls"; the stream adds up
    to the same. Returns the calls."""
    whole = chat(client, **kwargs).choices[0]
    calls = calls_of(whole.message)
    assert whole.message.content == content and calls and whole.finish_reason == "tool_calls"
    streamed_content, streamed_calls, finish_reason = gathered(chat(client, stream=True, **kwargs))
    assert streamed_content == (content or "") and finish_reason == "tool_calls"
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed_calls] == calls
    assert all(c["pieces"] > 1 for c in streamed_calls)  # the arguments came as the model wrote them
    return calls


def test_a_named_tool_choice_gives_a_call_valid_against_its_parameters(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    [call] = check_whole_and_streamed(client, None, tools=TOOLS, tool_choice=choice, logit_bias=COMPACT)
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_required_gives_calls_to_the_tools(client):
    [call] = check_whole_and_streamed(client, None, tools=TOOLS, tool_choice="required", logit_bias=ONE_ITEM)
    tool = next(t for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


def test_auto_reads_the_calls_the_model_writes(client):
    [call] = check_whole_and_streamed(client, "Sure.", tools=TOOLS,
                                      extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Rome")


def test_auto_leaves_text_without_calls_as_content(client):
    kwargs = dict(tools=TOOLS, tool_choice="auto", extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    whole = chat(client, **kwargs).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == ("It is sunny.", [], "stop")
    assert gathered(chat(client, stream=True, **kwargs)) == ("It is sunny.", [], "stop")


def test_none_leaves_a_tool_call_the_model_writes_as_content(client):
    whole = chat(client, tools=TOOLS, tool_choice="none",
                 extra_body={"structured_outputs": {"regex": HERMES_CALL}}).choices[0]
    assert whole.message.content.startswith("Sure. <tool_call>") and not whole.message.tool_calls
    assert whole.finish_reason == "stop"


def test_the_tools_and_the_history_of_calls_reach_the_chat_template(client, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    arguments = {"city": "Rome", "days": 2}
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."}]
    # The template gets each call's arguments as a dict, as transformers' templates take them.
    expected = [*MESSAGES,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "content": "Sunny, 24 C.", "tool_call_id": "call_1"}]
    rendered = tokenizer.apply_chat_template(expected, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert 'calls get_weather{"city": "Rome", "days": 2}' in rendered and "tools: get_weather get_time" in rendered
    usage = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1).usage
    assert usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    without_tools = tokenizer.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
    assert chat(client, messages=history, max_tokens=1).usage.prompt_tokens == len(
        tokenizer.encode(without_tools, add_special_tokens=False))


def test_bad_tool_requests_are_refused_naming_the_field(client):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
         "does not match any of the specified `tools`"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
              tool_choice="required"), "tools[0].function.parameters", "tools[0].function.parameters={'type': "
                                                                        "'objekt'} is not allowed"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
         "cannot be combined with response_format or structured_outputs"),
        (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{not json"}}]}]), "messages", "are not a JSON object"),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(openai.BadRequestError) as refusal:
            chat(client, **kwargs)
        error = refusal.value.body
        assert error["param"] == param and message in error["message"], error
