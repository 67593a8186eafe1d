"""What a request's output must look like: a JSON schema, any JSON object, a regex, a choice or a grammar.

``StructuredOutputsParams`` is checked when it is built: exactly one constraint, of the right type, that
xgrammar can turn into a grammar. The check needs no tokenizer, so a bad schema or regex fails where the
user writes it, before any request is added; compiling against the vocabulary comes later
(``StructuredOutputManager.grammar_init``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from micro_vllm.validation import reject, short_repr

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")

# String formats xgrammar turns into a grammar; any other format it ignores, and the output would not
# validate against the schema.
_XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})

# Keywords whose subschemas are schemas themselves: as one schema, a list of them, or a map to them.
_ONE_SUBSCHEMA = ("items", "additionalProperties", "contains", "propertyNames", "not", "if", "then", "else",
                  "unevaluatedProperties", "unevaluatedItems")
_LIST_OF_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP_OF_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on a request's output, as vLLM names them.

    ``json`` is a JSON schema (a dict, or its JSON text); ``json_object=True`` asks for any JSON
    object; ``regex`` is a regular expression the whole output matches; ``choice`` a list of strings,
    one of which is the whole output; ``grammar`` an EBNF grammar (GBNF style, with a ``root`` rule).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in _FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams has {', '.join(given) or 'none'} set; exactly one of {', '.join(_FIELDS)} "
                "must be set"
            )
        [name] = given
        value = getattr(self, name)
        object.__setattr__(self, name, _CHECKS[name](f"structured_outputs.{name}", value))

    @property
    def kind(self) -> str:
        """The one constraint that is set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(name for name in _FIELDS if getattr(self, name) is not None)

    def schema_text(self) -> str:
        """``json`` as JSON text (the grammar compiler's cache is keyed by it)."""
        return self.json if isinstance(self.json, str) else json.dumps(self.json)

    def choice_grammar(self) -> str:
        """``choice`` as an EBNF grammar: one quoted alternative per choice (JSON escapes are EBNF's too)."""
        return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in self.choice)


def _xgrammar_error(error: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0] if lines else type(error).__name__)


def _parse(name: str, value: object, allowed: str, build: Callable[[], object]) -> None:
    """Raise the field's error if xgrammar cannot build a grammar from it."""
    try:
        build()
    except Exception as e:  # xgrammar raises RuntimeError from C++ and ValueError from Python
        raise reject(name, value, f"{allowed}; xgrammar says: {_xgrammar_error(e)}") from e


def _check_json(name: str, value: object) -> dict[str, Any] | str:
    import xgrammar as xgr

    allowed = "a JSON schema (a dict or its JSON text)"
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise reject(name, value, f"{allowed}; it is not valid JSON ({e})") from e
    else:
        schema = value
    if not isinstance(schema, dict):
        raise reject(name, value, allowed, TypeError)
    unenforced = _unenforced_keyword(schema)
    if unenforced:
        raise reject(name, value, f"{allowed} without {unenforced}, which xgrammar cannot enforce")
    _parse(name, value, allowed, lambda: xgr.Grammar.from_json_schema(json.dumps(schema)))
    return value


def _unenforced_keyword(schema: object) -> str | None:
    """The first keyword in ``schema`` or its subschemas that xgrammar would silently ignore, described."""
    if not isinstance(schema, dict):
        return None
    if schema.get("uniqueItems") is True:
        return "'uniqueItems'"
    for keyword in ("not", "if", "dependentRequired", "dependentSchemas", "dependencies"):
        if keyword in schema:
            return repr(keyword)
    if schema.get("unevaluatedProperties", True) is not True:
        return "'unevaluatedProperties'"
    if len(schema.get("allOf", ())) > 1:
        return "'allOf' with several schemas"
    if "format" in schema and schema["format"] not in _XGRAMMAR_FORMATS:
        return f"'format': {short_repr(schema['format'])}"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return "'minLength'/'maxLength' beside 'pattern' or 'format'"
    subschemas = [schema.get(k) for k in _ONE_SUBSCHEMA]
    subschemas += [s for k in _LIST_OF_SUBSCHEMAS if isinstance(schema.get(k), list) for s in schema[k]]
    subschemas += [s for k in _MAP_OF_SUBSCHEMAS if isinstance(schema.get(k), dict) for s in schema[k].values()]
    return next(filter(None, map(_unenforced_keyword, subschemas)), None)


def _check_regex(name: str, value: object) -> str:
    import xgrammar as xgr

    allowed = "a non-empty regular expression"
    if not isinstance(value, str) or not value:
        raise reject(name, value, allowed, TypeError if not isinstance(value, str) else ValueError)
    if "\x00" in value:  # xgrammar's converter reads it as the end of the pattern
        raise reject(name, value, f"{allowed} without NUL characters")
    _parse(name, value, allowed, lambda: xgr.Grammar.from_regex(value))
    return value


def _check_choice(name: str, value: object) -> tuple[str, ...]:
    allowed = "a non-empty list of strings"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise reject(name, value, allowed, TypeError)
    if not value or not all(isinstance(option, str) for option in value):
        raise reject(name, value, allowed)
    return tuple(value)


def _check_grammar(name: str, value: object) -> str:
    import xgrammar as xgr

    allowed = "an EBNF grammar with a 'root' rule"
    if not isinstance(value, str) or not value.strip():
        raise reject(name, value, allowed, TypeError if not isinstance(value, str) else ValueError)
    _parse(name, value, allowed, lambda: xgr.Grammar.from_ebnf(value))
    return value


def _check_json_object(name: str, value: object) -> bool:
    if value is not True:
        raise reject(name, value, "True (or None, with another constraint set)")
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "json": _check_json,
    "regex": _check_regex,
    "choice": _check_choice,
    "grammar": _check_grammar,
    "json_object": _check_json_object,
}
