"""The base of the tool-call parsers, and their registry by name (``--tool-call-parser``).

A parser reads a model's output text into the text meant for the user (``content``) and the tool
calls in it, each a function name and its arguments as JSON text. It does so with one method,
``parse(text, final)``; the rest follows from it:

- a whole response (``extract_tool_calls``) is ``parse(text, final=True)``, and a tool call that is
  not well-formed makes the whole output plain content, as vLLM's parsers do;
- a stream (``extract_tool_calls_streaming``) sends, at each new piece of text, what ``parse`` of the
  text so far has grown by: new content, a new call (its id and name), more of a call's arguments. For
  that, ``parse(text, final=False)`` gives only what more text cannot change (a name once it is whole;
  no whitespace or half tag that may turn out to border a call), so that each parse of a growing text
  extends the last one, and the pieces streamed add up to what the whole response gives.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from micro_vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)


@dataclass(frozen=True)
class ToolCallText:
    """One tool call as read so far: its function's name and the JSON text of its arguments."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """An output's content, its tool calls, and whether every call is whole and well-formed."""

    content: str
    tool_calls: list[ToolCallText] = field(default_factory=list)
    valid: bool = True


@dataclass(frozen=True)
class ExtractedToolCallInformation:
    """What a whole response holds: its tool calls, if any, and the content beside them (None if none)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


def make_tool_call_id() -> str:
    """A tool call's id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Reads tool calls from one output (one choice of one request): a fresh parser for each, since a
    stream's parser remembers what it has sent."""

    def __init__(self) -> None:
        self._ids: list[str] = []  # of the calls streamed so far
        self._sent_arguments: list[str] = []
        self._sent_content = ""

    @classmethod
    def adjust_request(cls, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """The request as this parser needs it, for a request whose tool calls it will read."""
        return request

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and tool calls in ``text``; with ``final`` False, only what more text cannot
        change (module docstring)."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        parsed = self.parse(model_output, final=True)
        if not parsed.valid or not parsed.tool_calls:
            return ExtractedToolCallInformation(False, [], model_output)
        calls = [ToolCall(id=make_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.tool_calls]
        return ExtractedToolCallInformation(True, calls, parsed.content or None)

    def extract_tool_calls_streaming(self, current_text: str, finished: bool) -> DeltaMessage | None:
        """What the output, now ``current_text``, adds to what was streamed; None if nothing yet.
        ``finished``: the output is whole, and nothing is held back any longer."""
        parsed = self.parse(current_text, final=finished)
        if finished and not parsed.valid and not self._ids:
            parsed = ParsedOutput(current_text)  # no call after all: all of it is content, as in a whole response
        deltas = []
        for index, call in enumerate(parsed.tool_calls):
            if index == len(self._ids):
                self._ids.append(make_tool_call_id())
                self._sent_arguments.append(call.arguments)
                deltas.append(DeltaToolCall(index=index, id=self._ids[index], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                continue
            arguments = _growth(self._sent_arguments[index], call.arguments)
            if arguments:
                self._sent_arguments[index] += arguments
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))
        content = _growth(self._sent_content, parsed.content)
        self._sent_content += content
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas or None)

    @property
    def tools_streamed(self) -> bool:
        return bool(self._ids)


def _growth(before: str, now: str) -> str:
    """What ``now`` adds to ``before``. A parse extends the one before it; where a malformed output
    makes the last one read otherwise, what was sent stands (a stream cannot take it back)."""
    return now[len(before):] if now.startswith(before) else ""


class ToolParserManager:
    """The parsers by the name ``--tool-call-parser`` takes."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str):
        """A class decorator: register the parser under ``name``."""
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser
            return parser
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise ValueError(f"tool_call_parser={name!r} is not allowed; it must be one of {sorted(cls.tool_parsers)}")
        return cls.tool_parsers[name]
