"""``micro-vllm serve -tp 2`` on CPU, driven with the official ``openai`` client: the server's engine
process starts a worker process per rank, and a completion (greedy, streamed and not) and a
structured-output request give what one rank gives offline."""

from __future__ import annotations

import httpx
import openai
import pytest

from helpers.server import serve_process, spawned_by
from helpers.tiny_models import make_tiny_model
from micro_vllm import LLM, SamplingParams, StructuredOutputsParams

SETTINGS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8)
PROMPT, CITIES = "The sky is", ["Paris", "London", "Berlin"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("serve"))  # q/k/v biases, tied embeddings


@pytest.fixture(scope="module")
def server(model_dir):
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    with serve_process(str(model_dir), "-tp", "2", "--served-model-name", "tiny", *flags) as server:
        yield server


def test_a_completion_and_a_structured_output_equal_one_rank_offline(server, model_dir):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    greedy = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**greedy).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**greedy, stream=True))
    choice = client.completions.create(model="tiny", prompt="City: ", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": CITIES}}).choices[0].text
    assert httpx.get(f"{server.url}/health").status_code == 200
    [engine_pid] = spawned_by(server.process.pid)
    assert len(spawned_by(engine_pid)) == 2  # a worker per rank
    with LLM(model=str(model_dir), device="cpu", **SETTINGS) as llm:
        expected = llm.generate([PROMPT, "City: "], [
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=CITIES)),
        ], use_tqdm=False)
    assert [text, choice] == [output.outputs[0].text for output in expected]
    assert streamed == text and choice in CITIES
