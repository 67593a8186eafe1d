"""The tool-call parsers on text: a whole response's calls and content, the same text streamed in
pieces of every size adding up to the same calls and content (the first piece of each call carrying
its id and name), malformed calls left as content, and the registry's names."""

from __future__ import annotations

import json

import pytest

from micro_vllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from micro_vllm.entrypoints.openai.tool_parsers.forced_tool_parser import NamedToolParser, RequiredToolParser

HERMES = ToolParserManager.get_tool_parser("hermes")
LLAMA = ToolParserManager.get_tool_parser("llama3_json")

WEATHER = '{"city": "Paris", "days": [1, {"unit": "°C", "note": "} and </tool_call> in a string"}]}'


def whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    extracted = parser.extract_tool_calls(text)
    assert extracted.tools_called == bool(extracted.tool_calls)
    assert all(c.id.startswith("call_") and c.type == "function" for c in extracted.tool_calls)
    return extracted.content, [(c.function.name, c.function.arguments) for c in extracted.tool_calls]


def streamed(parser: ToolParser, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a stream of ``text`` in pieces of ``step`` characters adds up to."""
    content, calls, ids = "", [], []
    for end in range(step, len(text) + step, step):
        delta = parser.extract_tool_calls_streaming(text[:end], finished=end >= len(text))
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):  # a new call: its first piece names it
                assert call.id.startswith("call_") and call.id not in ids and call.type == "function"
                assert call.function.name and call.function.arguments is not None
                ids.append(call.id)
                calls.append((call.function.name, call.function.arguments))
            else:
                assert call.index == len(calls) - 1 and call.id is None and call.function.name is None
                calls[-1] = (calls[-1][0], calls[-1][1] + call.function.arguments)
    return content, calls


def check(parser_factory, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    """``text`` gives ``content`` and ``calls`` whole, and streamed in pieces of any size."""
    assert whole(parser_factory(), text) == (content, calls)
    for step in (1, 2, 3, 7, len(text)):
        assert streamed(parser_factory(), text, step) == (content or "", calls), step


@pytest.mark.parametrize("text, content, calls", [
    ("Just an answer, no call. ", "Just an answer, no call. ", []),
    ("<tool_call>\n" + '{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>",
     None, [("get_weather", WEATHER)]),
    ('Let me look. <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": 1}}\n</tool_call>\nDone.', "Let me look.Done.",
     [("a", "{}"), ("b", '{"x": 1}')]),
    # Keys the other way round: read once the call is whole, its arguments written out again.
    ('<tool_call>{"arguments": {"x":1}, "name": "b"}</tool_call>', None, [("b", '{"x": 1}')]),
    # A call the output ends in, its closing tag never written.
    ('<tool_call>{"name": "a", "arguments": {"q": "é"}}', None, [("a", '{"q": "é"}')]),
    ("a < b <tool and <tool_call", "a < b <tool and <tool_call", []),
])
def test_hermes(text, content, calls):
    check(HERMES, text, content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": ' + WEATHER + "}", None, [("get_weather", WEATHER)]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, 2]}}',
     None, [("a", "{}"), ("b", '{"x": [1, 2]}')]),
    ('  {"name": "a", "parameters": {"x": 1}} I called a.', "I called a.", [("a", '{"x": 1}')]),
    ("  <|python", "  <|python", []),
])
def test_llama3_json(text, content, calls):
    check(LLAMA, text, content, calls)


@pytest.mark.parametrize("parser, text", [
    (HERMES, 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'),  # a brace short
    (HERMES, '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f"}</tool_call>'),  # no arguments
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>\n<tool_call>'),
    (LLAMA, '{"name": "f", "parameters": {"a": 1}, "arguments": {}}'),  # both keys
    (LLAMA, '{"a": 1}'),  # JSON, but no call
    (LLAMA, '{"name": "f", "parameters": {"a": '),  # cut short
])
def test_a_malformed_call_leaves_the_whole_output_as_content(parser, text):
    assert whole(parser(), text) == (text, [])


def test_a_stream_with_no_well_formed_call_sends_the_whole_output_as_content():
    text = '{"a": 1} is JSON without a call'
    assert streamed(LLAMA(), text, 1) == (text, [])


def test_a_stream_holds_back_what_may_yet_be_a_tag_or_border_one():
    parser = HERMES()
    assert parser.extract_tool_calls_streaming("Hi <tool_", finished=False).content == "Hi"
    assert parser.extract_tool_calls_streaming("Hi <tool_c", finished=False) is None
    assert parser.extract_tool_calls_streaming("Hi <tool_cat", finished=False).content == " <tool_cat"
    llama = LLAMA()
    assert llama.extract_tool_calls_streaming(" <|py", finished=False) is None
    assert llama.extract_tool_calls_streaming(" <|py", finished=True).content == " <|py"


def test_named_and_required_read_a_constrained_output():
    arguments = '{"city": "Rome", "days": 3}'
    check(lambda: NamedToolParser("get_weather"), arguments, None, [("get_weather", arguments)])
    listed = '[{"name": "a", "parameters": ' + arguments + '}, {"name":"b","parameters":{}}]'
    check(RequiredToolParser, listed, None, [("a", arguments), ("b", "{}")])
    # Cut short by max_tokens: the calls as far as they go.
    assert whole(RequiredToolParser(), listed[:30]) == (None, [("a", listed[29:30])])


def test_streamed_arguments_add_up_to_json():
    text = "<tool_call>\n" + json.dumps({"name": "f", "arguments": {"s": "\\\"}{", "n": [1.5e3, None, True]}}) + "\n"
    content, [(name, arguments)] = streamed(HERMES(), text, 1)
    assert json.loads(arguments) == {"s": "\\\"}{", "n": [1.5e3, None, True]}


def test_the_registry_names_its_parsers():
    assert ToolParserManager.get_tool_parser("hermes") is HERMES
    with pytest.raises(ValueError, match=r"tool_call_parser='nope' is not allowed; it must be one of \['hermes', "
                                         r"'llama3_json'\]"):
        ToolParserManager.get_tool_parser("nope")
