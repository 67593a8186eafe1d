"""A script written against vLLM's offline API runs on micro-vLLM with only its package name and the
model's path changed: ``LLM.generate`` with ``n``, stop strings, logprobs and prompt logprobs, chat,
structured output, and the attributes such a script reads from the outputs."""

import json

import pytest

from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path

pytestmark = pytest.mark.real_model

# Written for vLLM: the usage of vLLM's documentation (quickstart, sampling parameters, structured
# outputs); ``check`` is the test's and collects what the script saw.
VLLM_SCRIPT = '''
import json

from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams

prompts = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
]
llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512, seed=0)
tokenizer = llm.get_tokenizer()

sampling_params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=1, max_tokens=24, stop=["\\n", "."],
                                 logprobs=5, prompt_logprobs=2)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    for completion in output.outputs:
        generated_text = completion.text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
        for token_id, top in zip(completion.token_ids, completion.logprobs):
            chosen = top[token_id]
            print(token_id, chosen.logprob, chosen.rank, chosen.decoded_token)
        check("completion", output.request_id, prompt, completion.index, completion.text, completion.token_ids,
              completion.finish_reason, completion.stop_reason, completion.cumulative_logprob, completion.logprobs)
    check("prompt_logprobs", prompt, output.prompt_token_ids, output.prompt_logprobs)

greedy = SamplingParams(temperature=0, max_tokens=32)
conversation = [{"role": "user", "content": "Write one sentence about the sea."}]
chat = llm.chat(conversation, greedy)
check("chat", chat[0].outputs[0].text)

schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"]}
json_params = SamplingParams(temperature=0, max_tokens=64,
                             structured_outputs=StructuredOutputsParams(json=schema))
answer = llm.generate("Name a city and its country, as JSON:", json_params)
check("json", json.loads(answer[0].outputs[0].text))

choice_params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
sentiment = llm.generate("vLLM is wonderful! Sentiment:", choice_params)
check("choice", sentiment[0].outputs[0].text)
'''


@pytest.fixture(scope="module")
def model_dir():
    try:
        return default_model_path()
    except DefaultModelUnavailable as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="module")
def seen(model_dir):
    assert VLLM_SCRIPT.count("from vllm") == 2
    script = VLLM_SCRIPT.replace("from vllm", "from micro_vllm").replace("HuggingFaceTB/SmolLM2-135M-Instruct",
                                                                         str(model_dir))
    records: dict[str, list] = {}

    def check(kind, *values):
        records.setdefault(kind, []).append(values)

    exec(compile(script, "vllm_script.py", "exec"), {"check": check, "__name__": "vllm_script"})
    return records


def test_n_stop_strings_and_logprobs(seen, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    completions = seen["completion"]
    assert len(completions) == 9  # three prompts, n=3
    for i, (request_id, prompt, index, text, token_ids, finish, stop, cumulative, logprobs) in enumerate(completions):
        assert index == i % 3 and prompt.startswith(("Hello", "The capital", "The future"))
        assert finish in ("stop", "length") and (stop in ("\n", ".", None))
        assert "\n" not in text and "." not in text  # cut before the stop string
        if stop is not None:
            assert stop in tokenizer.decode(token_ids)  # the stop string came from the tokens
        assert len(logprobs) == len(token_ids)
        for token_id, top in zip(token_ids, logprobs):
            assert token_id in top and len(top) in (5, 6)  # the top 5, and the sampled one if not among them
            ranks = sorted(entry.rank for entry in top.values())
            assert ranks[:5] == [1, 2, 3, 4, 5] and all(entry.logprob <= 0 for entry in top.values())
            assert top[token_id].decoded_token == tokenizer.decode([token_id])
        assert cumulative == pytest.approx(sum(top[t].logprob for t, top in zip(token_ids, logprobs)), abs=1e-4)
    assert len({tuple(c[4]) for c in completions[:3]}) > 1  # the three sequences of a prompt differ
    for prompt, prompt_token_ids, prompt_logprobs in seen["prompt_logprobs"]:
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_token_ids)
        assert all(token_id in top for token_id, top in zip(prompt_token_ids[1:], prompt_logprobs[1:]))


def test_chat_and_structured_outputs(seen):
    [(chat_text,)] = seen["chat"]
    assert chat_text.strip()
    [(answer,)] = seen["json"]
    assert isinstance(answer["city"], str) and isinstance(answer["country"], str)
    [(sentiment,)] = seen["choice"]
    assert sentiment in ("Positive", "Negative")
