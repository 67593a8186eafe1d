"""``micro-vllm serve`` under careless and hostile clients, on a tiny model.

Every bad request of the list the server was once tried with gets a 4xx in OpenAI's error shape, with
vLLM's message where vLLM has one and the field at fault as ``param``; logprobs JSON cannot carry are
sent as vLLM's floor; a large prompt, chat message or /tokenize body and a grammar that takes seconds
to compile do not hold up another client's stream; the request log is cut to ``--max-log-len``. Last,
Hypothesis sends random bodies to every route: each gets a 2xx or an OpenAI-shaped 4xx, never a 5xx,
and afterwards the server is healthy, idle, and gives a reference request the same output as before.
``MICRO_VLLM_FUZZ_EXAMPLES`` sets how many bodies (docs/serving.md records a long run)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
from micro_vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from micro_vllm.entrypoints.openai.serving import (
    LOGPROB_FLOOR,
    OpenAIServing,
    PreparedRequest,
    _ChatDeltas,
    _sse,
)
from micro_vllm.logprobs import Logprob
from helpers.server import TINY_CHAT_SERVER, metric, sse_data
from helpers.tiny_models import VOCAB_SIZE

MODEL = TINY_CHAT_SERVER.served_model_name
MAX_MODEL_LEN = TINY_CHAT_SERVER.max_model_len
MAX_BODY = TINY_CHAT_SERVER.max_request_body_bytes
MAX_LOG_LEN = TINY_CHAT_SERVER.max_log_len
MAX_LOGPROBS = TINY_CHAT_SERVER.max_logprobs
HEADERS = {"Authorization": f"Bearer {TINY_CHAT_SERVER.api_key}"}
REFERENCE = {"model": MODEL, "prompt": "The sky is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_server):
    """The server test_server.py and test_server_vllm_fields.py share (tests/entrypoints/conftest.py)."""
    return tiny_chat_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http):
    """The reference request's text before the random bodies."""
    return http.post("/v1/completions", json=REFERENCE).json()["choices"][0]["text"]


def nested(depth: int, inner: str = "{}") -> str:
    """A JSON schema nested ``depth`` levels deep, as JSON text."""
    return '{"type": "object", "properties": {"a": ' * depth + inner + "}}" * depth


MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}

# (route, body: JSON-able or raw bytes, status, param, a part of the message)
BAD_REQUESTS = {
    "completion prompt with a lone surrogate": (
        "/v1/completions", b'{"prompt": "a \\ud800"}', 400, None, "Invalid JSON"),
    "chat message with a lone surrogate": (
        "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a \\ud800"}]}', 400, None,
        "Invalid JSON"),
    "tokenize prompt with a lone surrogate": ("/tokenize", b'{"prompt": "a \\ud800"}', 400, None, "Invalid JSON"),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    "json_schema nested 250 levels": (
        "/v1/chat/completions", ('{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
                                 '"json_schema", "json_schema": {"name": "deep", "schema": ' + nested(250)
                                 + "}}}").encode(), 400, None, "recursion limit exceeded"),
    "chat max_tokens 0": (
        "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens",
        "max_tokens must be at least 1, got 0."),
    "chat max_completion_tokens 0": (
        "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens",
        "max_completion_tokens must be at least 1, got 0."),
    "max_tokens 2**63": (
        "/v1/completions", {"prompt": "x", "max_tokens": 2**63}, 400, "max_tokens",
        f"'max_tokens' or 'max_completion_tokens' is too large: {2**63}. This model's maximum context length is "
        f"{MAX_MODEL_LEN} tokens and your request has 1 input tokens"),
    "stream_options without stream": (
        "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
        "Stream options can only be defined when `stream=True`."),
    "top_logprobs without logprobs": (
        "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs",
        "when using `top_logprobs`, `logprobs` must be set to true."),
    "bools as prompt token ids": ("/v1/completions", {"prompt": [True, False]}, 400, "prompt", "valid integer"),
    "stop token id past the vocabulary": (
        "/v1/completions", {"prompt": "x", "stop_token_ids": [2**40]}, 400, "stop_token_ids",
        f"stop_token_ids contain [{2**40}] outside the vocabulary"),
    "top_logprobs 21": (
        "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
        "top_logprobs=21 is not allowed"),
    "max_completion_tokens -1": (
        "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -1}, 400, "max_completion_tokens",
        "got -1"),
    "a bad response_format schema": (
        "/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "objekt"}}}}, 400, "response_format.json_schema.schema",
        "response_format.json_schema.schema={'type': 'objekt'} is not allowed"),
    "a bad structured_outputs regex": (
        "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "("}}, 400, "structured_outputs.regex",
        "structured_outputs.regex='(' is not allowed"),
    "an empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt", "prompt is empty"),
    "bools as tokens to detokenize": ("/detokenize", {"tokens": [True]}, 400, "tokens", "valid integer"),
    "a body that is not UTF-8": ("/v1/completions", b'{"prompt": "\xff"}', 400, None, "Invalid JSON"),
    "JSON nested 100,000 deep": ("/v1/completions", b"[" * 100_000, 400, None, "recursion limit exceeded"),
    "a body over --max-request-body-bytes": (
        "/v1/completions", b" " * (MAX_BODY + 1), 413, None, f"this server takes at most {MAX_BODY}"),
    "an unknown model": ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    "tool_choice without tools": (
        "/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice",
        "When using `tool_choice`, `tools` must be set."),
    "an empty list of tools": (
        "/v1/chat/completions", {"messages": MESSAGES, "tools": []}, 400, "tools",
        "`tools` must not be an empty array"),
    "a tool that is not a function": (
        "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "retrieval"}]}, 400, "tools",
        "tools.0.type: Input should be 'function'"),
    "a tool_choice that is none of them": (
        "/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "sometimes"}, 400,
        "tool_choice", "Input should be 'none', 'auto' or 'required'"),
    "a tool_choice naming no tool": (
        "/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": {
            "type": "function", "function": {"name": "g"}}}, 400, "tool_choice",
        "The tool specified in `tool_choice` ('g') does not match any of the specified `tools`: ['f']"),
}


def check_error(response: httpx.Response, status: int) -> dict:
    """The response is OpenAI's error object with this status; its ``error``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"].endswith("Error") and "ErrorError" not in error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    return error


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_naming_the_field(http, case):
    route, body, status, param, message = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    error = check_error(http.post(route, content=content, headers={"Content-Type": "application/json"}), status)
    assert error["param"] == param and message in error["message"], error


def test_unknown_routes_and_methods_get_openai_errors(http):
    assert check_error(http.get("/v2/nothing"), 404)["type"] == "NotFoundError"
    response = http.get("/v1/completions")
    assert check_error(response, 405)["type"] == "MethodNotAllowedError" and response.headers["allow"] == "POST"


def test_a_chunked_body_over_the_limit_is_refused(http):
    chunks = (b" " * 1_000_000 for _ in range(5))  # no Content-Length: the server counts what arrives
    check_error(http.post("/v1/completions", content=chunks), 413)


def test_logprobs_json_cannot_carry_are_sent_as_the_floor(http):
    """Structured output with logprobs: whatever the model gives for the tokens the grammar forbids,
    every logprob sent, streamed or not, is a number JSON carries, at least vLLM's floor."""
    digits = {"structured_outputs": {"regex": "[0-9]{4}"}, "max_tokens": 8, "temperature": 0}
    completion = {"model": MODEL, "prompt": "Count:", "logprobs": MAX_LOGPROBS, **digits}
    chat = {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": MAX_LOGPROBS, **digits}
    values = []
    for stream in (False, True):
        for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            response = http.post(route, json={**body, "stream": stream})
            assert response.status_code == 200, response.text
            chunks = [json.loads(data) for data in sse_data([response.text])
                      if data.startswith("{")] if stream else [response.json()]
            for chunk in chunks:
                for choice in chunk["choices"]:
                    values += _logprob_values(choice.get("logprobs"))
    assert len(values) > 4 * 4 * 2 and all(math.isfinite(v) and v >= LOGPROB_FLOOR for v in values)


def _logprob_values(logprobs: dict | None) -> list[float]:
    if logprobs is None:
        return []
    if "content" in logprobs:  # chat
        return [v for c in logprobs["content"] for v in [c["logprob"], *(t["logprob"] for t in c["top_logprobs"])]]
    # an echoed prompt's first token has none
    return [v for v in logprobs["token_logprobs"] if v is not None] + [
        v for top in logprobs["top_logprobs"] if top is not None for v in top.values()]


class _Tokenizer:
    def decode(self, token_ids):
        return "".join(chr(97 + t) for t in token_ids)


class _Engine:
    tokenizer, max_model_len, vocab_size = _Tokenizer(), MAX_MODEL_LEN, VOCAB_SIZE


def test_minus_infinity_and_nan_logprobs_become_the_floor():
    """The serving layer alone, on logprobs no model should give but a broken one might."""
    serving = OpenAIServing(_Engine(), [MODEL], MODEL)
    position = {0: Logprob(float("-inf"), 1, "a"), 1: Logprob(float("nan"), 2, "b"), 2: Logprob(-0.5, 3, "c")}
    sequence = CompletionOutput(0, "ab", [0, 1], None, [position, position], finish_reason="length")
    completion = CompletionRequest(prompt="x", logprobs=3, echo=True)
    chat = ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=3, prompt_logprobs=3)
    try:
        for request in (completion, chat):
            prepared = PreparedRequest(request, "a", [0], None)
            output = RequestOutput("id", "a", [0, 1], [None, position], [sequence], True, 0)
            whole = json.loads(serving._response_json(request, [prepared], "id", MODEL, [output]))
            if request is chat:
                streamed = serving._chat_stream_choice(request, sequence, _ChatDeltas(None))
                prompt_logprobs = whole["prompt_logprobs"]
            else:
                streamed = serving._completion_choice(request, prepared, sequence, 0, [None, position], first=True)
                prompt_logprobs = whole["choices"][0]["prompt_logprobs"]
            streamed_json = json.loads(_sse(streamed).removeprefix("data: "))  # a choice: a model, or a dict of one
            for logprobs in (whole["choices"][0]["logprobs"], streamed_json["logprobs"]):
                assert sorted(set(_logprob_values(logprobs))) == [LOGPROB_FLOOR, -0.5]
            assert sorted({entry["logprob"] for entry in prompt_logprobs[1].values()}) == [LOGPROB_FLOOR, -0.5]
    finally:
        serving.shutdown()


def test_the_request_log_is_cut_to_max_log_len(server, http):
    prompt = "a prompt much longer than the log keeps"
    assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    line = next(line for line in reversed(server.output().splitlines()) if "Received request cmpl-" in line)
    assert f"prompt: {prompt[:MAX_LOG_LEN]!r}," in line and prompt[:MAX_LOG_LEN + 1] not in line


# -- heavy requests beside a stream -----------------------------------------------------------------


HEAVY_TEXT = "All work and no play makes Jack a dull boy. " * 12_000  # 528 KB: seconds of tokenizing
# A schema whose grammar takes xgrammar seconds to compile: thousands of optional properties.
SLOW_SCHEMA = {"type": "object", "properties": {f"property_{i}": {"type": "string"} for i in range(2400)}}


def test_heavy_requests_do_not_stall_another_stream(server):
    """While a large prompt, chat message and /tokenize body are tokenized and a slow grammar compiles,
    another client streams: no gap between its chunks (or between one of its requests ending and the
    next one's first chunk) reaches a second. Once, the tokenizing ran on the event loop and the compile
    in the engine's step loop, and every stream waited for them."""
    heavy = [
        ("/v1/completions", {"prompt": HEAVY_TEXT}, 400),  # too long for the model, once tokenized
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": HEAVY_TEXT}]}, 400),
        ("/tokenize", {"prompt": HEAVY_TEXT}, 200),
        ("/v1/completions", {"prompt": "{", "max_tokens": 20, "temperature": 0,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "slow",
                                                                                        "schema": SLOW_SCHEMA}}}, 200),
    ]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=300) as client:
            heavy_done = asyncio.Event()

            async def send_heavy():  # one after the other: the machine has two cores, the stream needs one
                try:
                    return [await client.post(route, json=body) for route, body, _ in heavy]
                finally:
                    heavy_done.set()

            async def stream_meanwhile():
                times, requests = [time.monotonic()], 0
                while not heavy_done.is_set():
                    async with client.stream("POST", "/v1/completions", json={**REFERENCE, "stream": True}) as stream:
                        async for line in stream.aiter_lines():
                            if line.startswith("data:"):
                                times.append(time.monotonic())
                    requests += 1
                return requests, max(b - a for a, b in zip(times, times[1:]))

            return await asyncio.gather(send_heavy(), stream_meanwhile())

    responses, (requests, largest_gap) = asyncio.run(main())
    for response, (route, _, status) in zip(responses, heavy):
        assert response.status_code == status, (route, response.text[:300])
    assert responses[2].json()["count"] == len(HEAVY_TEXT)  # one token a byte
    assert responses[3].json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert requests >= 3 and largest_gap < 1.0, (requests, largest_gap)


# -- random bodies ----------------------------------------------------------------------------------


INTERESTING_INTS = st.sampled_from([-2**63, -1, 0, 1, 2, 3, 5, 20, 21, 127, 128, 2**31, 2**63, 10**30])
INTERESTING_FLOATS = st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.5, 100.0, 1e300, -1e-300, math.nan, math.inf])
ODD_TEXT = st.sampled_from(["", "a \ud800 b", "\x00", "é😀", "x" * 200, "<s>", "[0-9]+", 'root ::= "a"', "user"])
TEXT = st.text(max_size=12) | ODD_TEXT
SCALARS = st.none() | st.booleans() | INTERESTING_INTS | st.integers(-3, 300) | INTERESTING_FLOATS | TEXT
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(TEXT, inner, max_size=4), max_leaves=10)
TOKEN_IDS = st.lists(st.integers(1, VOCAB_SIZE - 1), min_size=1, max_size=8)
ROLE = st.sampled_from(["user", "system", "assistant"])
SOME_TEXT = st.text(min_size=1, max_size=16)

# Values a client would send, nearly all of them valid (n and max_tokens small, to keep requests short).
PLAUSIBLE = {
    "model": st.just(MODEL),
    "prompt": SOME_TEXT | TOKEN_IDS | st.lists(SOME_TEXT, min_size=1, max_size=3) | st.lists(TOKEN_IDS, min_size=1,
                                                                                             max_size=3),
    "messages": st.lists(st.fixed_dictionaries({"role": ROLE, "content": SOME_TEXT}), min_size=1, max_size=3),
    "tokens": TOKEN_IDS,
    "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8), "n": st.integers(1, 3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(SOME_TEXT, max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()},
                                            optional={"continuous_usage_stats": st.booleans()}),
    "logprobs": st.integers(0, 5), "top_logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB_SIZE - 1).map(str), st.floats(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 4), "ignore_eos": st.booleans(),
    "stop_token_ids": TOKEN_IDS, "allowed_token_ids": TOKEN_IDS,
    "bad_words": st.lists(SOME_TEXT, max_size=2),
    "structured_outputs": st.sampled_from([{"regex": "[0-9]{1,3}"}, {"choice": ["yes", "no"]},
                                           {"json": {"type": "object"}}, {"json_object": True},
                                           {"grammar": 'root ::= "a" | "b"'}]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"]}}}]),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(), "add_special_tokens": st.booleans(),
    "tools": st.just([TOOL]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "echo": st.booleans(), "prompt_logprobs": st.integers(0, 5), "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(), "return_token_strs": st.booleans(),
}
TOOL_CALL = st.fixed_dictionaries({"id": TEXT, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT, "arguments": TEXT | st.just('{"a": 1}')})})
MESSAGE = st.fixed_dictionaries({"role": TEXT, "content": TEXT | st.none() | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | TEXT, "text": TEXT}), max_size=2)},
    optional={"tool_calls": st.lists(TOOL_CALL, max_size=2) | ANY_JSON, "tool_call_id": TEXT | ANY_JSON})
# Values a careless or hostile client sends: out of range, of the wrong type, odd text, any JSON.
HOSTILE = {
    "model": st.just("gpt-4") | TEXT,
    "prompt": TEXT | st.lists(INTERESTING_INTS | st.booleans() | st.integers(-2, 300), max_size=8) | st.lists(
        TEXT | st.lists(st.integers(-2, 300)), max_size=2),
    "messages": st.lists(MESSAGE, max_size=3),
    "n": st.sampled_from([-1, 0, 16385, 2**40, 1.5, "2"]),
    "logprobs": st.booleans() | st.integers(-2, 22), "top_logprobs": st.integers(-2, 22),
    "prompt_logprobs": st.booleans() | st.integers(-2, 22), "max_tokens": st.integers(-1, 1),
    "logit_bias": st.dictionaries(st.sampled_from(["5", "-1", "300", "x", "1e3"]), INTERESTING_FLOATS, max_size=3),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object"])
                                          | TEXT, ANY_JSON, max_size=2),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | TEXT},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"name": TEXT, "schema": ANY_JSON})}),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function") | TEXT, "function": st.fixed_dictionaries(
        {"name": TEXT}, optional={"parameters": ANY_JSON})}) | ANY_JSON, max_size=2),
    "tool_choice": TEXT | ANY_JSON | st.fixed_dictionaries({"type": st.just("function"),
                                                            "function": st.fixed_dictionaries({"name": TEXT})}),
}
ROUTES = {
    ("POST", "/v1/completions"): ["prompt", "model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p",
                                  "seed", "stop", "stream", "stream_options", "logprobs", "presence_penalty",
                                  "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos",
                                  "stop_token_ids", "allowed_token_ids", "bad_words", "structured_outputs",
                                  "response_format", "include_stop_str_in_output", "skip_special_tokens", "echo",
                                  "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids"],
    ("POST", "/v1/chat/completions"): ["messages", "model", "max_tokens", "max_completion_tokens", "n",
                                       "temperature", "top_p", "seed", "stop", "stream", "stream_options", "logprobs",
                                       "top_logprobs", "logit_bias", "min_tokens", "ignore_eos", "structured_outputs",
                                       "response_format", "add_generation_prompt", "tools", "tool_choice",
                                       "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids"],
    ("POST", "/invocations"): ["prompt", "messages", "max_tokens", "stream", "echo", "logprobs", "n"],
    ("POST", "/tokenize"): ["prompt", "model", "add_special_tokens", "return_token_strs"],
    ("POST", "/tokenize", "chat form"): ["messages", "add_special_tokens", "add_generation_prompt",
                                         "return_token_strs"],
    ("POST", "/detokenize"): ["tokens", "model"],
    ("GET", "/v1/models"): [], ("GET", "/health"): [], ("GET", "/metrics"): [], ("GET", "/load"): [],
    ("GET", "/version"): [], ("GET", "/tokenizer_info"): [],
    ("GET", "/v1/completions"): [], ("DELETE", "/tokenize"): [], ("POST", "/v1/nothing"): [],
}


@st.composite
def random_requests(draw) -> tuple[str, str, bytes]:
    """A route and a body: a plausible one (its first field, the one the route needs, and a few
    others), the same with a field or two hostile, any JSON, or any bytes."""
    route = draw(st.sampled_from(list(ROUTES)))
    method, path = route[:2]
    kind = draw(st.sampled_from(["plausible"] * 3 + ["hostile"] * 3 + ["json", "bytes"]))
    if kind == "bytes":
        return method, path, draw(st.binary(max_size=64))
    if kind == "json" or not ROUTES[route]:
        return method, path, json.dumps(draw(ANY_JSON)).encode()
    required, *optional = ROUTES[route]
    names = [required] + draw(st.lists(st.sampled_from(optional), unique=True, max_size=5))
    body = {name: draw(PLAUSIBLE[name]) for name in names}
    if kind == "hostile":
        for name in draw(st.lists(st.sampled_from(names + optional), unique=True, min_size=1, max_size=2)):
            body[name] = draw(HOSTILE.get(name, INTERESTING_INTS | INTERESTING_FLOATS) | ANY_JSON)
    return method, path, json.dumps(body).encode()  # lone surrogates and NaN go out as JSON writes them


def check_response(response: httpx.Response) -> None:
    if response.status_code >= 400:
        check_error(response, response.status_code)
        assert response.status_code < 500
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = list(sse_data([response.text]))
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    elif response.headers.get("content-type", "").startswith("application/json"):
        response.json()


@settings(max_examples=int(os.environ.get("MICRO_VLLM_FUZZ_EXAMPLES", "300")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=random_requests())
def test_random_bodies_get_a_2xx_or_an_openai_4xx(http, reference, request):
    method, path, body = request
    response = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    event(f"{method} {path}: {response.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    assert response.status_code < 500, (method, path, body, response.text[:2000])
    check_response(response)


def test_the_server_is_healthy_and_unchanged_after_the_random_bodies(server, http, reference):
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    while True:
        text = http.get("/metrics").text
        busy = [metric(text, f"vllm:{name}") for name in ("num_requests_running", "num_requests_waiting",
                                                           "kv_cache_usage_perc")]
        if busy == [0, 0, 0]:
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.1)
    assert http.post("/v1/completions", json=REFERENCE).json()["choices"][0]["text"] == reference
    assert "Traceback" not in server.output()
