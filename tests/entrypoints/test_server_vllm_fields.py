"""vLLM's server interface beyond OpenAI's, on a real ``micro-vllm serve`` of a tiny model, driven with the
official ``openai`` client (httpx for the routes that are not OpenAI's): a list of prompts in one
completion request, ``echo`` (the prompt's logprobs equal to the offline ``prompt_logprobs``),
``prompt_logprobs``, ``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs=0``,
``stream_options.continuous_usage_stats``, /tokenize's token strings and chat form, /tokenizer_info,
/version, /load, /invocations and ``--max-logprobs``."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from helpers.server import TINY_CHAT_SERVER
from helpers.tiny_models import BOS_TOKEN_ID
from micro_vllm import LLM, SamplingParams, __version__
from micro_vllm.entrypoints.openai.api_server import ServerLoad, _LoadTracker
from micro_vllm.entrypoints.openai.serving import MAX_COMPLETION_PROMPTS

MODEL = TINY_CHAT_SERVER.served_model_name
MAX_MODEL_LEN = TINY_CHAT_SERVER.max_model_len
MAX_LOGPROBS = TINY_CHAT_SERVER.max_logprobs
API_KEY = TINY_CHAT_SERVER.api_key
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_path(tiny_chat_model):
    return tiny_chat_model


@pytest.fixture(scope="module")
def server(tiny_chat_server):
    """The server test_server.py and test_bad_requests.py share (tests/entrypoints/conftest.py)."""
    return tiny_chat_server.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        yield http


def complete(client, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 3)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_list_of_prompts_gives_each_its_n_choices_in_order(client):
    prompts = ["Hello", "The sky is", [65, 66, 67]]
    kwargs = dict(n=2, temperature=1.0, seed=7, max_tokens=3, extra_body={"ignore_eos": True})
    alone = [complete(client, [p] if isinstance(p, list) else p, **kwargs) for p in prompts]
    texts = complete(client, prompts[:2], **kwargs)
    id_prompts = [[*p.encode()] for p in prompts[:2]] + [prompts[2]]  # one token a byte
    ids = complete(client, id_prompts, **kwargs)
    for batch, expected in ((texts, alone[:2]), (ids, alone)):
        assert [c.index for c in batch.choices] == list(range(2 * len(expected)))
        assert [c.text for c in batch.choices] == [c.text for one in expected for c in one.choices]
        assert batch.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in expected)
        assert batch.usage.completion_tokens == 6 * len(expected)
    chunks = list(complete(client, id_prompts, stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(6)] == [c.text for c in ids.choices]
    assert chunks[-1].usage == ids.usage


def test_echo_gives_the_prompts_logprobs_as_offline_prompt_logprobs(client, model_path):
    prompts = ["The sky is", "abc"]
    echoed = complete(client, prompts, echo=True, logprobs=1, max_tokens=0)
    llm = LLM(model=str(model_path), device="cpu", max_model_len=MAX_MODEL_LEN)
    offline = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    for prompt, choice, output in zip(prompts, echoed.choices, offline):
        logprobs = choice.logprobs
        assert choice.text == prompt and logprobs.tokens == list(prompt)  # one token a byte
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        expected = [position[token].logprob for position, token in
                    zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]
        assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        assert logprobs.text_offset == list(range(len(prompt)))
    assert echoed.usage.completion_tokens == 0
    # With tokens to generate: the prompt, then the completion; streamed, the prompt comes in the first chunk.
    plain = complete(client, "abc", logprobs=1)
    both = complete(client, "abc", logprobs=1, echo=True)
    assert both.choices[0].text == "abc" + plain.choices[0].text
    assert both.choices[0].logprobs.token_logprobs[3:] == plain.choices[0].logprobs.token_logprobs
    chunks = list(complete(client, "abc", logprobs=1, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith("abc")
    assert "".join(c.choices[0].text for c in chunks) == both.choices[0].text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == both.choices[0].logprobs.token_logprobs
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == both.choices[0].logprobs.text_offset
    streamed_alone = list(complete(client, "abc", echo=True, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed_alone) == "abc"


def test_prompt_logprobs_in_completions_and_chat(client, model_path):
    response = complete(client, "Hello", extra_body={"prompt_logprobs": 2})
    prompt_logprobs = response.choices[0].prompt_logprobs
    assert len(prompt_logprobs) == 5 and prompt_logprobs[0] is None
    for position, token in zip(prompt_logprobs[1:], b"ello"):
        assert str(token) in position and 2 <= len(position) <= 3  # the prompt's token and the top 2
        assert {entry["rank"] for entry in position.values() if entry["rank"] <= 2} == {1, 2}
    assert position[str(token)]["decoded_token"] == "o"
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens == len(chat.prompt_token_ids)
    assert all(list(p) == [str(t)] for p, t in zip(chat.prompt_logprobs[1:], chat.prompt_token_ids[1:]))
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs") as error:
        complete(client, "Hello", stream=True, extra_body={"prompt_logprobs": 1})
    assert error.value.body["param"] == "prompt_logprobs"


def test_token_ids_and_tokens_as_token_ids(client, http, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    response = complete(client, "héllo", logprobs=1, extra_body={"return_token_ids": True,
                                                                  "return_tokens_as_token_ids": True})
    choice = response.choices[0]
    assert choice.prompt_token_ids == tokenizer.encode("héllo")
    assert len(choice.token_ids) == response.usage.completion_tokens
    assert tokenizer.decode(choice.token_ids) == choice.text
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(set(top) <= {f"token_id:{t}" for t in range(260)} for top in choice.logprobs.top_logprobs)
    chunks = list(complete(client, "héllo", stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert sum((c.choices[0].token_ids for c in chunks), []) == choice.token_ids
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                          extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    assert chat.prompt_token_ids == http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert [c.token for c in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert sum((c.choices[0].token_ids or [] for c in chunks), []) == chat.choices[0].token_ids


def test_logprobs_zero_gives_the_sampled_tokens_own(client):
    logprobs = complete(client, "Hello", logprobs=0, temperature=1.0, seed=3).choices[0].logprobs
    assert len(logprobs.top_logprobs) == 3
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top == {token: logprob}


def test_continuous_usage_stats(client):
    for create, body in ((client.completions.create, {"prompt": "Hello"}),
                         (client.chat.completions.create, {"messages": MESSAGES})):
        chunks = list(create(model=MODEL, **body, max_tokens=4, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True},
                             extra_body={"ignore_eos": True}))
        *with_choices, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 4
        counts = [c.usage.completion_tokens for c in with_choices]
        assert counts == sorted(counts) and counts[-1] == 4
        assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in with_choices)
        no_usage = list(create(model=MODEL, **body, max_tokens=2, stream=True,
                               stream_options={"continuous_usage_stats": True}))
        assert all(c.usage is None for c in no_usage)  # vLLM's rule: only with include_usage


def test_tokenize_tokenizer_info_version_and_load(http, model_path):
    tokens = http.post("/tokenize", json={"prompt": "hé", "return_token_strs": True}).json()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"]) and len(tokens["token_strs"]) == 3
    chat = {"messages": MESSAGES, "add_generation_prompt": False}
    assert http.post("/tokenize", json=chat).json()["tokens"] == [BOS_TOKEN_ID, *b"user: hi\n"]
    assert http.post("/tokenize", json={**chat, "add_special_tokens": True}).json()["tokens"] == \
        tokenizer.encode("<s>user: hi\n", add_special_tokens=True)
    assert refusal(http.post("/tokenize", json={"prompt": "x", "messages": MESSAGES}))["param"] == "prompt"
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["chat_template"] == tokenizer.chat_template
    assert not any(key.endswith("_file") for key in info)
    assert http.get("/version").json() == {"version": __version__}
    assert http.get("/load").json() == {"server_load": 0}


def test_load_counts_generation_requests_until_their_response_ends():
    """The middleware alone, around an app whose response ends when the test says so (a real stream
    on the tiny model may be all sent before the client reads its first chunk)."""
    load, release = ServerLoad(), asyncio.Event()

    async def app(scope, receive, send):
        await release.wait()

    async def main():
        tracker = _LoadTracker(app, load)
        requests = [asyncio.create_task(tracker({"type": "http", "path": path}, None, None))
                    for path in ("/v1/completions", "/v1/chat/completions", "/invocations")]
        other = asyncio.create_task(tracker({"type": "http", "path": "/tokenize"}, None, None))
        await asyncio.sleep(0)
        counted = load.count
        release.set()
        await asyncio.gather(*requests, other)
        return counted

    assert asyncio.run(main()) == 3 and load.count == 0


def test_invocations_routes_by_body(http):
    chat = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 2}).json()
    completion = http.post("/invocations", json={"prompt": "Hello", "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and completion["object"] == "text_completion"
    assert refusal(http.post("/invocations", json={"max_tokens": 2}))["param"] == "prompt"
    assert refusal(http.post("/invocations", content=b"{not json"))["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
     "top_logprobs"),
])
def test_max_logprobs_caps_every_logprobs_field(http, path, body, param):
    error = refusal(http.post(path, json=body))
    assert error["param"] == param and f"max_logprobs is {MAX_LOGPROBS}" in error["message"]


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
    ({"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs", "prompt_logprobs=-2 is not allowed"),
    ({"prompt": ["x", ""]}, "prompt", "prompt is empty"),
    ({"prompt": [[1]] * (MAX_COMPLETION_PROMPTS + 1)}, "prompt", f"prompt list length {MAX_COMPLETION_PROMPTS + 1} "
     f"exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}"),
    ({"prompt": [[1, 2], [300]], "echo": True}, "prompt", "outside the vocabulary"),
    ({"prompt": ["x", "y" * MAX_MODEL_LEN]}, "prompt", "maximum context length"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": -1}, "prompt_logprobs", "not available when `stream=True`"),
])
def test_bad_values_are_refused_naming_the_field(http, body, param, message):
    error = refusal(http.post("/v1/completions", json=body))
    assert error["param"] == param and message in error["message"]
