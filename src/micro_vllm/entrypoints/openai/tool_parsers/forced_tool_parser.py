"""The parsers of a forced ``tool_choice``, whose output a JSON schema has shaped (vLLM's way): a named
function's output is its arguments object; ``"required"``'s is a JSON array of calls,
``[{"name": "f", "parameters": {...}}, ...]``. Their output has no content. An output cut short (by
``max_tokens``) gives the calls as far as they go."""

from __future__ import annotations

from micro_vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolCallText, ToolParser
from micro_vllm.entrypoints.openai.tool_parsers.utils import ToolCallReader, json_object_end, skip_whitespace


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [ToolCallText(self.name, text)])


class RequiredToolParser(ToolParser):
    reader = ToolCallReader(["parameters"])

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls = []
        position = skip_whitespace(text, 0)
        if text.startswith("[", position):
            position += 1
            while True:
                position = skip_whitespace(text, position)
                if not text.startswith("{", position):
                    break
                end = json_object_end(text, position)
                call, _ = self.reader.read(text[position:end], whole=end is not None)
                if call is not None:
                    calls.append(call)
                if end is None:
                    break
                position = skip_whitespace(text, end)
                if not text.startswith(",", position):
                    break
                position += 1
        return ParsedOutput("", calls)
