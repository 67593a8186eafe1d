"""Reading one tool call's JSON object, ``{"name": ..., "arguments": {...}}``, whole or as far as it goes.

The arguments are sent as the very text the model wrote, so that a stream can send them as they come
and its pieces add up to the whole response's; only a call whose keys come in another order (name
last) is read once whole, and its arguments written out again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from micro_vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolCallText

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")


def skip_whitespace(text: str, position: int) -> int:
    return _WHITESPACE.match(text, position).end()


def json_object_end(text: str, position: int) -> int | None:
    """Where the JSON object starting at ``position`` ends, or None if it is not whole (or not JSON)."""
    try:
        value, end = _DECODER.raw_decode(text, position)
    except ValueError:
        return None
    return end if isinstance(value, dict) else None


def _name_then_arguments(argument_keys: Sequence[str]) -> re.Pattern:
    keys = "|".join(map(re.escape, argument_keys))
    return re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:' + keys + r')"\s*:\s*')


class ToolCallReader:
    """Reads calls whose arguments are under one of ``argument_keys`` ("arguments", "parameters")."""

    def __init__(self, argument_keys: Sequence[str]) -> None:
        self.argument_keys = tuple(argument_keys)
        self._prefix = _name_then_arguments(argument_keys)

    def read(self, text: str, whole: bool) -> tuple[ToolCallText | None, bool]:
        """The call in ``text`` (None until its name is known) and whether it is a well-formed call.
        ``whole``: no more text will come for this call; else ``text`` may be cut anywhere."""
        prefix = self._prefix.match(text)
        if prefix is None:
            if not whole:
                return None, False
            found = self._call_object(text)
            if found is None:
                return None, False
            name, arguments = found
            return ToolCallText(name, json.dumps(arguments, ensure_ascii=False)), True
        name = json.loads(prefix.group(1))
        start = prefix.end()
        end = json_object_end(text, start)
        if end is None:  # the arguments are not whole yet: all of them so far, if they are an object
            arguments = text[start:] if text.startswith("{", start) else ""
            return ToolCallText(name, arguments), False
        well_formed = whole and self._call_object(text) is not None
        return ToolCallText(name, text[start:end]), well_formed

    def _call_object(self, text: str) -> tuple[str, dict] | None:
        """The name and arguments of ``text`` if it is exactly one call's JSON object."""
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        keys = [key for key in self.argument_keys if key in call]
        if len(keys) != 1 or not isinstance(call[keys[0]], dict):
            return None
        return call["name"], call[keys[0]]
