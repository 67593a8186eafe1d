"""Tool calling in chat requests, as vLLM does it: what ``tools`` and ``tool_choice`` ask for.

- ``tools`` go to the chat template (``apply_chat_template(tools=...)``), whatever the choice.
- ``tool_choice`` ``"auto"`` (the default when tools are given) lets the model answer or call tools;
  the server's parser (``--enable-auto-tool-choice --tool-call-parser NAME``) finds the calls in the
  output. Without that flag such a request is refused, as vLLM refuses it.
- ``"none"`` (the default without tools): the output is content.
- A named function, ``{"type": "function", "function": {"name": ...}}``, or ``"required"`` force the
  output with structured output: a JSON schema of the function's parameters, or of a list of calls to
  any of the tools; the output is returned as tool calls.
"""

from __future__ import annotations

import json

from micro_vllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatMessageParam,
    OpenAIError,
)
from micro_vllm.entrypoints.openai.tool_parsers import ToolParser
from micro_vllm.entrypoints.openai.tool_parsers.forced_tool_parser import NamedToolParser, RequiredToolParser
from micro_vllm.structured_output import StructuredOutputsParams

# A function that takes no parameters takes an empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_choice(request: ChatCompletionRequest) -> str | ChatCompletionNamedToolChoiceParam:
    """The request's choice, OpenAI's default filled in: "auto" with tools, "none" without."""
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def prepare_tool_request(request: ChatCompletionRequest,
                         auto_parser: type[ToolParser] | None) -> ChatCompletionRequest:
    """The request checked (a 400 naming the field), and adjusted for its choice: a forced choice's
    constraint in ``structured_outputs``, an auto choice as the server's parser needs it.
    ``auto_parser``: the server's parser for "auto", None if it has none."""
    if request.tools is not None and not request.tools:
        raise OpenAIError("`tools` must not be an empty array; give at least one tool, or leave the field out",
                          param="tools")
    choice = tool_choice(request)
    if choice == "none":
        return request
    if not request.tools:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                              param="tool_choice")
        return auto_parser.adjust_request(request)
    if request.structured_outputs is not None or (request.response_format is not None
                                                  and request.response_format.type != "text"):
        raise OpenAIError("a forced tool_choice ('required' or a named function) shapes the output itself; it cannot "
                          "be combined with response_format or structured_outputs", param="tool_choice")
    return request.model_copy(update={"structured_outputs": {"json": _forced_schema(request, choice)}})


def tool_parser_for(request: ChatCompletionRequest, auto_parser: type[ToolParser] | None) -> ToolParser | None:
    """A fresh parser for one output of a prepared request, or None if its output is only content."""
    choice = tool_choice(request)
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return NamedToolParser(choice.function.name)
    if choice == "required":
        return RequiredToolParser()
    return auto_parser() if choice == "auto" else None


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template takes them."""
    return None if request.tools is None else [tool.model_dump(exclude_none=True) for tool in request.tools]


def template_tool_calls(message: ChatMessageParam) -> list[dict]:
    """An assistant message's tool calls for the chat template, which takes each call's arguments as a
    dict, not as the JSON text OpenAI's messages hold (transformers' convention; vLLM converts them too)."""
    calls = []
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise OpenAIError(f"the arguments of tool call {call.id!r} in messages are not a JSON object: "
                              f"{call.function.arguments[:100]!r}", param="messages")
        calls.append({"id": call.id, "type": call.type,
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def _forced_schema(request: ChatCompletionRequest, choice: str | ChatCompletionNamedToolChoiceParam) -> dict:
    """The JSON schema of a forced choice's output, each tool's parameters checked as a schema first."""
    names = [tool.function.name for tool in request.tools]
    if choice == "required":
        indices = range(len(request.tools))
    elif choice.function.name in names:
        indices = [names.index(choice.function.name)]
    else:
        raise OpenAIError(f"The tool specified in `tool_choice` ({choice.function.name!r}) does not match any of the "
                          f"specified `tools`: {names}", param="tool_choice")
    parameters = {i: _checked_parameters(request, i) for i in indices}
    if choice != "required":
        return parameters[indices[0]]
    definitions: dict[str, dict] = {}
    calls = []
    for i, schema in parameters.items():
        # "$ref": "#/$defs/..." points at the root: a tool's definitions move up to the list's schema.
        schema = dict(schema)
        for key, definition in schema.pop("$defs", {}).items():
            if definitions.setdefault(key, definition) != definition:
                raise OpenAIError(f"tools define '$defs/{key}' twice, differently; tool_choice='required' needs "
                                  "one definition per name", param="tools")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [names[i]]},
                                                       "parameters": schema},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return {**schema, "$defs": definitions} if definitions else schema


def _checked_parameters(request: ChatCompletionRequest, index: int) -> dict:
    parameters = request.tools[index].function.parameters or _NO_PARAMETERS
    field = f"tools[{index}].function.parameters"
    try:
        StructuredOutputsParams(json=parameters)
    except ValueError as error:
        raise OpenAIError(str(error).replace("structured_outputs.json", field, 1), param=field) from None
    return parameters


def tool_finish_reason(finish_reason: str | None, tools_called: bool) -> str | None:
    """An output that called tools and ended by itself finished for "tool_calls", as OpenAI says; one
    cut short keeps "length"."""
    return "tool_calls" if tools_called and finish_reason == "stop" else finish_reason
