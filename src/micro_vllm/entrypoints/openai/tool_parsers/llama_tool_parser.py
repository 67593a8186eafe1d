"""Llama 3's JSON format (``--tool-call-parser llama3_json``): an output that starts (after whitespace)
with a JSON object, or with ``<|python_tag|>``, is tool calls, ``{"name": "f", "parameters": {...}}``
(or ``"arguments"``), several of them separated by ``;``; text after the last call is content. Any
other output is all content."""

from __future__ import annotations

from micro_vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from micro_vllm.entrypoints.openai.tool_parsers.utils import ToolCallReader, json_object_end, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    reader = ToolCallReader(["parameters", "arguments"])

    def parse(self, text: str, final: bool) -> ParsedOutput:
        position = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, position):
            position += len(PYTHON_TAG)
        elif not text.startswith("{", position):
            if not final and PYTHON_TAG.startswith(text[position:]):
                return ParsedOutput("")  # whitespace, or what may yet be the tag: undecided
            return ParsedOutput(text)
        calls, valid = [], final
        while True:
            position = skip_whitespace(text, position)
            if not text.startswith("{", position):
                break
            end = json_object_end(text, position)
            whole = end is not None or final
            call, well_formed = self.reader.read(text[position:end], whole)
            if call is None and end is not None:  # JSON, but not a call: content from here on
                return ParsedOutput(text[position:] if calls else text, calls, False)
            if call is not None:
                calls.append(call)
            valid = valid and well_formed
            if end is None:
                position = len(text)
                break
            position = skip_whitespace(text, end)
            if not text.startswith(";", position):
                break
            position += 1
        return ParsedOutput(text[position:], calls, valid and bool(calls))
