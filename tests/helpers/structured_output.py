"""The structured-output workload: prompts with JSON schemas (nested objects, enums, arrays, required
and optional fields, numbers, booleans), regexes, choices, a grammar and json_object; how to check
the outputs, and how to run them through ``LLM.generate`` as chat prompts."""

from __future__ import annotations

import json
import re

import jsonschema

from micro_vllm import LLM, CompletionOutput, SamplingParams, StructuredOutputsParams

MAX_TOKENS = 64


def obj(required: bool = True, **properties: dict) -> dict:
    schema = {"type": "object", "properties": properties}
    return {**schema, "required": list(properties)} if required else schema


def string(max_length: int = 12) -> dict:
    return {"type": "string", "maxLength": max_length}


def integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def array(items: dict, min_items: int = 0, max_items: int = 2) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


# (prompt, schema): nested objects, enums, arrays, required and optional fields, numbers, booleans.
SCHEMAS = [
    ("Describe a person.", obj(name=string(), age=integer(0, 120))),
    ("Is Paris a capital?", obj(city=string(), is_capital={"type": "boolean"})),
    ("Pick a color.", obj(color={"enum": ["red", "green", "blue"]})),
    ("List a few small numbers.", obj(numbers=array(integer(0, 9), 1, 4))),
    ("Give today's temperature.", obj(celsius={"type": "number", "minimum": -50, "maximum": 50})),
    ("Describe a user account.", obj(user=obj(id=integer(1, 999), active={"type": "boolean"}))),
    ("Make a shopping list.", obj(items=array(obj(name=string(8), qty=integer(1, 9)), 1))),
    ("Describe a book.", {**obj(required=False, title=string(), pages=integer(1, 999)), "required": ["title"]}),
    ("Name some fruits.", array({"enum": ["apple", "pear", "plum"]}, 1, 3)),
    ("Which API version?", obj(version={"const": 2}, name=string(6))),
    ("Give a value.", obj(value={"anyOf": [integer(0, 99), {"type": "boolean"}]})),
    ("Where do you live?", obj(address=obj(city=string(), zip={"type": "string", "pattern": "^[0-9]{5}$"}))),
    ("Give an airport code.", obj(code={"type": "string", "pattern": "^[A-Z]{3}$"})),
    ("Full name, please.", obj(first=string(10), middle={"type": ["string", "null"], "maxLength": 8})),
    ("When was the Eiffel Tower built?", obj(year=integer(1800, 2100))),
    ("When is the meeting?", obj(date={"type": "string", "format": "date"})),
    ("Give a point.", {
        "$defs": {"point": obj(x=integer(-9, 9), y=integer(-9, 9))}, "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}}, "required": ["start"],
    }),
    ("Is the sky blue?", {"type": "boolean"}),
    ("Tag this ticket.", obj(tags=array({"enum": ["bug", "ui", "docs"]}), urgent={"type": "boolean"})),
    ("Count and ratio.", obj(count={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
                                 ratio={"type": "number", "exclusiveMinimum": 0, "maximum": 1})),
]
PHONE = r"[0-9]{3}-[0-9]{4}"
CITY = r"[A-Z][a-z]{2,8}"
CAPITALS = ["Paris", "London", "Berlin", 'a "quoted" \\ choice']
SENTIMENTS = ["positive", "negative", "neutral"]
SUM_GRAMMAR = 'root ::= "(" number " + " number ")"\nnumber ::= [1-9] [0-9]?'
SUM_REGEX = r"\([1-9][0-9]? \+ [1-9][0-9]?\)"
OTHERS = [
    ("Give a phone number.", StructuredOutputsParams(regex=PHONE)),
    ("Name a city.", StructuredOutputsParams(regex=CITY)),
    ("What is the capital of France?", StructuredOutputsParams(choice=CAPITALS)),
    ("I love this film! Sentiment?", StructuredOutputsParams(choice=SENTIMENTS)),
    ("Write a sum of two numbers.", StructuredOutputsParams(grammar=SUM_GRAMMAR)),
    ('Reply with {"ok": true} and nothing else.', StructuredOutputsParams(json_object=True)),
]
REQUESTS = [(prompt, StructuredOutputsParams(json=schema)) for prompt, schema in SCHEMAS] + OTHERS


def chat_texts(tokenizer, prompts: list[str]) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts]


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer(chat_texts(tokenizer, [prompt])[0]).input_ids


# Each of OTHERS' prompts -> whether a whole output matches its constraint.
OTHER_CHECKS = {
    "Give a phone number.": lambda text: re.fullmatch(PHONE, text),
    "Name a city.": lambda text: re.fullmatch(CITY, text),
    "What is the capital of France?": lambda text: text in CAPITALS,
    "I love this film! Sentiment?": lambda text: text in SENTIMENTS,
    "Write a sum of two numbers.": lambda text: re.fullmatch(SUM_REGEX, text),
    'Reply with {"ok": true} and nothing else.': lambda text: isinstance(json.loads(text), dict),
}


def check_others(outputs: dict[str, str]) -> None:
    """The outputs of OTHERS' prompts given match their constraints."""
    for prompt, matches in OTHER_CHECKS.items():
        if prompt in outputs:
            assert matches(outputs[prompt]), (prompt, outputs[prompt])


def check_all(outputs: dict[str, str]) -> None:
    """Every output of OTHERS' prompts and of the SCHEMAS' prompts given matches its constraint."""
    for prompt, schema in SCHEMAS:
        if prompt in outputs:
            jsonschema.validate(json.loads(outputs[prompt]), schema)
    check_others(outputs)


def generate(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> dict[str, CompletionOutput]:
    """Each prompt's output, the prompts given as their chat template's token ids."""
    prompts = [{"prompt_token_ids": chat_prompt_ids(llm.engine.tokenizer, prompt)} for prompt, _ in requests]
    outputs = llm.generate(prompts, [params for _, params in requests], use_tqdm=False)
    return {prompt: output.outputs[0] for (prompt, _), output in zip(requests, outputs)}
