"""``micro-vllm serve`` on the default model (SmolLM2-135M-Instruct, CPU), driven with the official
``openai`` client: a chat answer through the model's own template, streamed text equal to the
non-streamed text for the same seed, a stop string on real text, and (once SamplingParams has
``structured_outputs``) a JSON schema the answer validates against."""

import json

import openai
import pytest

from micro_vllm.model_loader.default_model_download import DEFAULT_MODEL, DefaultModelUnavailable, default_model_path
from helpers.server import serve_process

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def client():
    try:
        model_dir = default_model_path()
    except DefaultModelUnavailable as e:  # no PyPI access, or gguf/accelerate missing
        pytest.skip(f"default model unavailable: {e}")
    with serve_process(str(model_dir), "--served-model-name", DEFAULT_MODEL, "--max-model-len", "256",
                       "--attention-backend", "sdpa") as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_chat_answers_through_the_chat_template(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, temperature=0, max_tokens=12)
    choice = response.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"  # ended by the model's EOS
    assert response.usage.completion_tokens <= 12 and response.usage.prompt_tokens > 20  # the template's system turn
    seeded = dict(model=DEFAULT_MODEL, messages=messages, temperature=1.0, seed=4, max_tokens=6)
    full = client.chat.completions.create(**seeded).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**seeded, stream=True))
    assert streamed == full


def test_completion_stops_at_a_stop_string(client):
    response = client.completions.create(model=DEFAULT_MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12,
                                         stop=[" 6"])
    choice = response.choices[0]
    assert choice.text == " 4, 5," and choice.finish_reason == "stop" and choice.stop_reason == " 6"


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]}},
              "required": ["capital"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        temperature=0, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert json.loads(response.choices[0].message.content) == {"capital": "Paris"}


def test_a_choice_beside_min_tokens_still_answers_with_a_choice(client):
    """``min_tokens`` past the end of every choice holds back EOS where the grammar allows only EOS:
    the grammar wins, and the answer is a choice that ends with "stop"."""
    response = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        temperature=0, max_tokens=10, extra_body={"min_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}})
    choice = response.choices[0]
    assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"
