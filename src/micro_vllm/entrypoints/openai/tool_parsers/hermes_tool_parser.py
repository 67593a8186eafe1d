"""The Hermes format (``--tool-call-parser hermes``), which Qwen2.5 and Qwen3 use too: each call a JSON
object between tags, ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any text around them
being content. Whitespace that borders a tag is not content (models put newlines around the tags)."""

from __future__ import annotations

from micro_vllm.entrypoints.openai.protocol import ChatCompletionRequest
from micro_vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from micro_vllm.entrypoints.openai.tool_parsers.utils import ToolCallReader, json_object_end, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    reader = ToolCallReader(["arguments"])

    @classmethod
    def adjust_request(cls, request: ChatCompletionRequest) -> ChatCompletionRequest:
        # Some models' tokenizers (Hermes 2 Pro's) mark the tags special: decoding must keep them.
        return request.model_copy(update={"skip_special_tokens": False})

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, calls, valid = [], [], True
        position = 0
        while True:
            start = text.find(START, position)
            after_call = position > 0
            if start < 0:
                tail = text[position:]
                if not final:  # what may yet become a tag, or whitespace before one
                    tail = _without_tag_start(tail, START).rstrip()
                content.append(tail.lstrip() if after_call else tail)
                break
            before = text[position:start]
            content.append((before.lstrip() if after_call else before).rstrip())
            body_start = start + len(START)
            end = _end_tag(text, body_start, final)
            whole = end >= 0 or final
            body = text[body_start:end] if end >= 0 else text[body_start:]
            if not whole:
                body = _without_tag_start(body, END)
            call, well_formed = self.reader.read(body, whole)
            if call is not None:
                calls.append(call)
            valid = valid and well_formed
            if end < 0:
                break
            position = end + len(END)
        return ParsedOutput("".join(content), calls, valid)


def _end_tag(text: str, body_start: int, final: bool) -> int:
    """Where the call that starts at ``body_start`` ends: the end tag after its JSON object (one inside
    a string of it does not count), -1 if there is none yet. A stream waits for the object to be whole,
    unless the output is: its text goes nowhere else meanwhile."""
    object_end = json_object_end(text, skip_whitespace(text, body_start))
    if object_end is None and not final:
        return -1
    return text.find(END, body_start if object_end is None else object_end)


def _without_tag_start(text: str, tag: str) -> str:
    """``text`` without an ending that could be the start of ``tag`` (the rest of it still to come)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return text[:-length]
    return text
