"""A real ``micro-vllm serve`` process on a tiny model, driven with the official ``openai`` client:
completions and chat, streamed and not, stop strings, usage; a client that disconnects mid-stream is
aborted and its blocks freed, and one that leaves before its first token is never prefilled (a server
of its own, with one slot; then its engine is killed: a stream in flight ends with the engine's error
and the server exits with status 1, saying why in its log, as vLLM's API server exits so that a
supervisor starts a fresh one); vLLM's metric families and what requests add to them; a load of concurrent
streaming clients with disconnects and malformed requests mixed in; error statuses. Fields that other
parts of the engine add (``n``, logprobs, penalties, logit_bias) are tested here too, and skipped until
SamplingParams has them (structured outputs: in test_server_default_model.py, which a random model
could not finish)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.server import TINY_CHAT_SERVER, metric, spawned_by, sse_data
from helpers.tiny_models import BOS_TOKEN_ID

API_KEY = TINY_CHAT_SERVER.api_key
MODEL = TINY_CHAT_SERVER.served_model_name
MAX_MODEL_LEN = TINY_CHAT_SERVER.max_model_len
PROMPTS = ["Hello", "The sky is", "1, 2, 3,", "Once upon a time", "abc", "Paris is", "def f(x):", "Why"]


@pytest.fixture(scope="module")
def server(tiny_chat_server):
    """The server test_server_vllm_fields.py and test_bad_requests.py share (tests/entrypoints/conftest.py)."""
    return tiny_chat_server.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def complete(client, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 6)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def metrics(server) -> str:
    return httpx.get(f"{server}/metrics").text


def assert_idle(server, timeout: float = 10.0) -> str:
    """Wait until no request runs or waits and no KV block is in use; return the metrics."""
    end = time.monotonic() + timeout
    while True:
        text = metrics(server)
        figures = [metric(text, f"vllm:{name}") for name in
                   ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if figures == [0, 0, 0]:
            return text
        assert time.monotonic() < end, f"still busy after {timeout} s: running, waiting, kv usage = {figures}"
        time.sleep(0.1)


def test_completion_streamed_equals_non_streamed(client):
    kwargs = dict(temperature=0.9, seed=11, max_tokens=8, extra_body={"ignore_eos": True})
    full = complete(client, "The sky is", **kwargs)
    text, chunks = stream_text(complete(client, "The sky is", stream=True, stream_options={"include_usage": True},
                                        **kwargs))
    assert full.choices[0].text and text == full.choices[0].text
    assert full.choices[0].finish_reason == "length" and chunks[-2].choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens == len("The sky is")  # one token a byte
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    other_seed = complete(client, "The sky is", **{**kwargs, "seed": 12})
    assert other_seed.choices[0].text != full.choices[0].text


def test_chat_streamed_equals_non_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kwargs = dict(model=MODEL, messages=messages, temperature=0.8, seed=3, max_completion_tokens=6)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and full.object == "chat.completion"
    rendered = "system: Be brief.\nuser: Hi there\nassistant:"  # the template's text, one token a byte
    assert full.usage.prompt_tokens == len(rendered.encode()) + 2  # and one token for each <s>
    assert full.usage.completion_tokens <= 6 and full.choices[0].finish_reason in ("stop", "length")


def test_stop_string_cuts_the_text(client):
    full = complete(client, "Once upon a time", max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text
    stop = next(ch for ch in full[2:] if ch.isalnum())  # a character the greedy text reaches later
    cut = complete(client, "Once upon a time", max_tokens=12, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    streamed, chunks = stream_text(complete(client, "Once upon a time", max_tokens=12, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert streamed == cut.text and chunks[-1].choices[0].finish_reason == "stop"


def test_a_disconnected_client_is_aborted_and_its_blocks_freed(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 110, "temperature": 0, "ignore_eos": True,
            "stream": True}
    aborted_before = _aborted(metrics(server))
    with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            busy = metrics(server)
            assert metric(busy, "vllm:num_requests_running") == 1 and metric(busy, "vllm:kv_cache_usage_perc") > 0
    assert _aborted(assert_idle(server)) == aborted_before + 1
    _give_up_while_running(server, {**body, "stream": False})  # a response that is not streamed
    assert _aborted(assert_idle(server)) == aborted_before + 2


def _give_up_while_running(server: str, body: dict) -> None:
    """Send ``body`` to /v1/completions and close the connection once the server runs it, before any
    reply: a client that gives up waiting, whatever the engine's speed."""
    payload = json.dumps(body).encode()
    url = httpx.URL(server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((url.host, url.port)) as connection:
        connection.sendall(head + payload)
        end = time.monotonic() + 10
        while metric(metrics(server), "vllm:num_requests_running") != 1:
            assert time.monotonic() < end, "the request never ran"


def _aborted(text: str) -> float:
    try:
        return metric(text, "vllm:request_success_total", finished_reason="abort")
    except KeyError:
        return 0.0


def test_load_with_disconnects_and_malformed_requests(server, client):
    max_tokens = 5
    alone = {p: complete(client, p, max_tokens=max_tokens, extra_body={"ignore_eos": True}).choices[0].text
             for p in PROMPTS}
    rng = random.Random(0)
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)

    async def stream_one(prompt: str, disconnect_after: int | None):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        text, chunks = "", 0
        async with stream:
            async for chunk in stream:
                if chunks == disconnect_after:
                    return None  # leaving the block closes the connection mid-stream
                text, chunks = text + chunk.choices[0].text, chunks + 1
        return prompt, text

    async def malformed(http: httpx.AsyncClient, i: int):
        kind = i % 4
        if kind == 0:
            response = await http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                                        headers={"Content-Type": "application/json"})
        elif kind == 1:
            response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7})
        elif kind == 2:
            response = await http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * MAX_MODEL_LEN})
        else:
            response = await http.post("/v1/chat/completions", json={"model": MODEL})
        return response.status_code

    # A quarter of the clients leave after 0 to 3 chunks. A stream that falls behind gets several
    # tokens per chunk, so only those that leave at the first chunk surely leave mid-stream.
    disconnect_after = [rng.randint(0, 3) if i % 4 == 0 else None for i in range(64)]

    async def main():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=60) as http:
            streams = [stream_one(PROMPTS[i % len(PROMPTS)], disconnect_after[i]) for i in range(64)]
            bad = [malformed(http, i) for i in range(8)]
            jobs = streams + bad
            rng.shuffle(jobs)
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    statuses = [r for r in results if isinstance(r, int)]
    completed = [r for r in results if isinstance(r, tuple)]
    assert statuses == [400] * 8
    assert len(completed) + results.count(None) == 64 and results.count(None) >= disconnect_after.count(0) > 0
    for prompt, text in completed:
        assert text == alone[prompt], prompt
    assert_idle(server)
    assert httpx.get(f"{server}/health").status_code == 200
    assert complete(client, PROMPTS[0], max_tokens=max_tokens, extra_body={"ignore_eos": True}).choices[0].text \
        == alone[PROMPTS[0]]


def test_error_statuses(server, client):
    http = httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"})
    requests_before = metric(metrics(server), "vllm:prompt_tokens_total")

    def error(response, status: int) -> dict:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert body["code"] == status and body["message"] and body["type"]
        return body

    error(http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    assert error(http.post("/v1/completions", json={"model": MODEL}), 400)["param"] == "prompt"
    assert error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}), 400)["param"] == "max_tokens"
    body = error(http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400)
    assert body["param"] == "temperature" and "-1" in body["message"]
    body = error(http.post("/v1/completions", json={"prompt": "x" * MAX_MODEL_LEN}), 400)
    assert f"maximum context length is {MAX_MODEL_LEN}" in body["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * MAX_MODEL_LEN}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    wrong_key = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong_key.completions.create(model=MODEL, prompt="x", stream=True)
    assert httpx.post(f"{server}/v1/completions", json={"prompt": 1.5}).status_code == 401  # the key before the body
    assert metric(metrics(server), "vllm:prompt_tokens_total") == requests_before  # nothing reached the engine
    assert httpx.get(f"{server}/health").status_code == 200


def test_models_tokenize_detokenize_and_metrics(server, client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.max_model_len == MAX_MODEL_LEN
    http = httpx.Client(base_url=server)
    tokens = http.post("/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["tokens"] == list("héllo".encode()) and tokens["count"] == 6 and tokens["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == [BOS_TOKEN_ID, *b"user: hi\nassistant:"]
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


# vLLM's metric families (its PrometheusStatLogger's), less those docs/serving.md lists as left out.
METRIC_FAMILIES = {
    "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"],
    "counter": ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
                "request_success"],
    "histogram": ["iteration_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                  "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                  "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                  "request_params_max_tokens", "request_params_n", "request_max_num_generation_tokens"],
}


def _samples(text: str) -> tuple[dict[str, str], dict[tuple[str, str | None], float]]:
    """Each vllm: family's type, and each sample's value by its name and finish reason (if any)."""
    families = {f.name: f for f in text_string_to_metric_families(text)  # the parser makes each _created a gauge
                if f.name.startswith("vllm:") and not f.name.endswith("_created")}
    for family in families.values():
        for sample in family.samples:  # the cache's settings are its info's labels, without the model's name
            assert sample.labels["engine"] == "0", sample
            assert sample.labels.get("model_name") == (None if family.name == "vllm:cache_config_info" else MODEL)
    values = {(s.name, s.labels.get("finished_reason")): s.value for f in families.values() for s in f.samples}
    return {name: f.type for name, f in families.items()}, values


def test_metrics_count_what_was_sent(server, client):
    """vLLM's metric families, each there with vLLM's labels, and what a few requests add to them."""
    _, before = _samples(assert_idle(server))
    prompts, max_tokens = ["Hello", "The sky is", "1, 2, 3,"], 5
    for prompt in prompts:
        response = complete(client, prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == max_tokens
    _, alone = _samples(assert_idle(server))
    # One at a time: a step per token, each giving one token (the first with its prompt).
    assert alone["vllm:iteration_tokens_total_count", None] - before.get(("vllm:iteration_tokens_total_count", None),
                                                                         0.0) == len(prompts) * max_tokens
    [n_request] = [complete(client, "abc", max_tokens=max_tokens, n=2, extra_body={"ignore_eos": True})]
    assert len(n_request.choices) == 2
    types, after = _samples(assert_idle(server))
    assert types == {f"vllm:{name}": kind for kind, names in METRIC_FAMILIES.items() for name in names}
    assert after["vllm:cache_config_info", None] == 1

    def added(name: str, reason: str | None = None) -> float:
        return after[f"vllm:{name}", reason] - before.get((f"vllm:{name}", reason), 0.0)

    num_sequences = len(prompts) + 2  # the n=2 request's two sequences count as two requests, as in vLLM
    prompt_tokens = sum(map(len, prompts)) + 2 * len("abc")  # one token a byte
    generated = num_sequences * max_tokens
    assert added("request_success_total", "length") == num_sequences
    assert added("request_success_total", "stop") == added("request_success_total", "abort") == 0
    assert added("prompt_tokens_total") == added("request_prompt_tokens_sum") == prompt_tokens
    assert added("generation_tokens_total") == added("request_generation_tokens_sum") == generated
    assert added("request_params_max_tokens_sum") == num_sequences * max_tokens
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert added(f"{name}_count") == num_sequences, name
    assert added("inter_token_latency_seconds_count") == generated - num_sequences
    assert (added("request_params_n_count"), added("request_params_n_sum")) == (len(prompts) + 1, len(prompts) + 2)
    assert added("request_max_num_generation_tokens_sum") == (len(prompts) + 1) * max_tokens
    assert added("iteration_tokens_total_sum") == prompt_tokens + generated
    assert added("prefix_cache_queries_total") >= prompt_tokens


def test_serve_benchmark_runs_against_the_server(server, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import serve as serve_benchmark

    serve_benchmark.main(["--url", server, "--api-key", API_KEY, "--num-requests", "6", "--request-rate", "inf",
                          "50", "--concurrency", "3", "--max-prompt-len", "20", "--max-output-len", "4",
                          "--vocab-size", "256", "--client-processes", "2"])
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["request_rate"], r["concurrency"], r["num_requests"]) for r in runs] == [("inf", 3, 6), (50, 3, 6)]
    for r in runs:
        assert r["output_tokens"] == 6 * 4 and r["output_tokens_per_s"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]


# -- vLLM's sampling fields ------------------------------------------------------------------------


def test_n(client):
    response = complete(client, "Hello", n=3, temperature=1.0, seed=5, max_tokens=4, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert response.usage.completion_tokens == 12
    chunks = list(complete(client, "Hello", n=3, temperature=1.0, seed=5, max_tokens=4, stream=True,
                           extra_body={"ignore_eos": True}))
    for choice in response.choices:
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == choice.index) \
            == choice.text


def test_logprobs(client):
    choice = complete(client, "Hello", logprobs=2, max_tokens=4, extra_body={"ignore_eos": True}).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    for logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        # greedy: the sampled token is the best; two tokens may decode to the same text (a partial UTF-8 byte)
        assert logprob <= 0 and 1 <= len(top) <= 2 and max(top.values()) <= logprob + 1e-5
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                          max_completion_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_penalties_min_p_and_min_tokens_are_accepted(client):
    response = complete(client, "Hello", temperature=0.7, seed=1, presence_penalty=0.5, frequency_penalty=0.5,
                        extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 3})
    assert response.usage.completion_tokens >= 3
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        complete(client, "Hello", presence_penalty=5)


def test_logit_bias_forces_a_token(client):
    response = complete(client, "Hello", logit_bias={str(ord("z")): 100}, max_tokens=4, extra_body={"ignore_eos": True})
    assert response.choices[0].text == "zzzz"


def test_tools_with_auto_tool_choice_need_its_flags(one_slot_server):
    """A server started without --enable-auto-tool-choice refuses a request with tools, whose
    tool_choice is then "auto", naming tool_choice (the shared server has the flags)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = httpx.post(f"{one_slot_server.url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and error["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')


def test_clients_that_leave_before_their_first_token_are_never_prefilled(one_slot_server):
    """A request holds the only slot (``--max-num-seqs 1``) while others with long prompts wait behind
    it; their clients leave before any token. The server notices without a first token and the engine
    aborts them while they wait: once the slot is free, none of their prompts is prefilled (a prompt
    counts in vllm:prompt_tokens at its first token), and a request after them runs at once."""
    url = one_slot_server.url
    with httpx.Client(base_url=url, timeout=60) as http:
        holding = {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}  # runs for seconds
        with http.stream("POST", "/v1/completions", json=holding) as response:
            lines = response.iter_lines()  # kept: a closed iterator closes the response
            assert next(line for line in lines if line.startswith("data:"))
            leaving = [_send_raw(url, {"prompt": "x" * 200, "max_tokens": 5, "stream": stream}) for stream in
                       (True, False, True, False)]
            _wait_for(url, "vllm:num_requests_waiting", len(leaving))
            for connection in leaving:
                connection.close()
            _wait_for(url, "vllm:num_requests_waiting", 0)
            assert metric(metrics(url), "vllm:num_requests_running") == 1, "the holding request ended first"
        assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3}).status_code == 200
        text = assert_idle(url)
    assert metric(text, "vllm:prompt_tokens_total") == len("Hi") + len("Hello")  # one token a byte
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == len(leaving) + 1
    assert metric(text, "vllm:request_queue_time_seconds_count") == len(leaving) + 2


def _send_raw(url: str, body: dict) -> socket.socket:
    """A connection that has sent ``body`` to /v1/completions and reads nothing."""
    payload = json.dumps(body).encode()
    address = httpx.URL(url)
    connection = socket.create_connection((address.host, address.port))
    connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {address.host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return connection


def _wait_for(url: str, name: str, value: float, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while metric(metrics(url), name) != value:
        assert time.monotonic() < end, f"{name} never reached {value}"
        time.sleep(0.05)


def test_the_server_exits_when_its_engine_dies(one_slot_server):
    """Last on this server: its engine's process is killed while a stream is in flight."""
    body = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=one_slot_server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = sse_data(response.iter_text())
            assert "choices" in json.loads(next(events))
            [engine_pid] = spawned_by(one_slot_server.process.pid)
            os.kill(engine_pid, signal.SIGKILL)
            last = [event for event in events][-2:]
    assert last[1] == "[DONE]"
    assert json.loads(last[0])["error"]["message"] == "the engine process was killed by SIGKILL"
    assert one_slot_server.process.wait(timeout=60) == 1
    assert "the engine process was killed by SIGKILL; shutting the server down" in one_slot_server.output()
