"""vLLM's offline examples run on the default model: scripts written the way vLLM 0.11's examples
are, importing from ``vllm`` (renamed ``micro_vllm`` here; ``IMPORTS`` maps vLLM's ``v1`` module paths),
naming vLLM's model (replaced by the default model's path). They cover the LLM built from a parsed
command line (``basic/generate.py`` and ``basic/chat.py``, with ``metrics.py``'s metrics dump), the
``LLMEngine`` add/step loop (``llm_engine_example.py``) and ``AsyncLLM`` streaming
(``async_llm_streaming.py``).

They are cut to CPU sizes (fewer prompts and tokens, a small KV cache); where one uses the interface
otherwise than vLLM's example does, a comment in it says how. ``check`` is the test's, and collects
what a script saw."""

import sys

import pytest

from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path

pytestmark = pytest.mark.real_model

VLLM_MODEL = "meta-llama/Llama-3.2-1B-Instruct"
# A CPU-sized engine: few sequences, short contexts (the KV cache is sized from them).
SIZE_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "8"]

GENERATE_SCRIPT = '''
import dataclasses

from vllm import LLM, EngineArgs
from vllm.utils import FlexibleArgumentParser
from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector


def create_parser():
    parser = FlexibleArgumentParser()
    # Add engine args
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model="meta-llama/Llama-3.2-1B-Instruct")
    # Add sampling params
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    parser.add_argument("--chat-template-path", type=str)
    return parser


def main(args: dict):
    # Pop arguments not used by LLM
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    top_p = args.pop("top_p")
    top_k = args.pop("top_k")
    chat_template_path = args.pop("chat_template_path")

    # Create an LLM
    llm = LLM(**args)
    check("llm", llm)

    # Create a sampling params object. vLLM's example sets each given field on the object in place
    # (sampling_params.max_tokens = max_tokens); micro-vLLM's SamplingParams is frozen.
    sampling_params = llm.get_default_sampling_params()
    given = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    sampling_params = dataclasses.replace(sampling_params, **{k: v for k, v in given.items() if v is not None})

    # Generate texts from the prompts.
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
        check("generate", prompt, output.outputs[0].token_ids)

    # basic/chat.py: a conversation, a batch of it, and a chat template read from a file
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    check("chat", outputs[0].prompt, outputs[0].outputs[0].text, outputs[0].outputs[0].token_ids)
    outputs = llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=True)
    check("chat_batch", [o.outputs[0].token_ids for o in outputs])
    if chat_template_path:
        with open(chat_template_path) as f:
            chat_template = f.read()
        outputs = llm.chat([conversation], sampling_params, use_tqdm=False, chat_template=chat_template)
        check("chat_template", outputs[0].prompt, outputs[0].outputs[0].token_ids)

    # metrics.py: dump all metrics
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            print(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, Counter):
            print(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, Vector):
            print(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, Histogram):
            print(f"{metric.name} (histogram)")
            print(f"    sum = {metric.sum}")
            print(f"    count = {metric.count}")
            for bucket_le, value in metric.buckets.items():
                print(f"    {bucket_le} = {value}")
        check("metric", metric)


if __name__ == "__main__":
    parser = create_parser()
    args: dict = vars(parser.parse_args())
    main(args)
'''

LLM_ENGINE_SCRIPT = '''
import argparse

from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from vllm.utils import FlexibleArgumentParser


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    """Create a list of test prompts with their sampling parameters."""
    return [
        ("A robot may not injure a human being",
         SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
        ("To be or not to be,",
         SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?",
         SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
    ]


def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
    """Continuously process a list of prompts and handle the outputs."""
    request_id = 0

    print("-" * 50)
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1

        request_outputs: list[RequestOutput] = engine.step()

        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
                print("-" * 50)
                check("finished", request_output)


def initialize_engine(args: argparse.Namespace) -> LLMEngine:
    """Initialize the LLMEngine from the command line arguments."""
    engine_args = EngineArgs.from_cli_args(args)
    return LLMEngine.from_engine_args(engine_args)


def parse_args():
    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    return parser.parse_args()


def main(args: argparse.Namespace):
    """Main function that sets up and runs the prompt processing."""
    engine = initialize_engine(args)
    check("tokenizer", engine.get_tokenizer())
    test_prompts = create_test_prompts()
    process_requests(engine, test_prompts)


if __name__ == "__main__":
    args = parse_args()
    main(args)
'''

ASYNC_SCRIPT = '''
import asyncio

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> None:
    print(f"Prompt: {prompt!r}")
    print("Response: ", end="", flush=True)

    # Configure sampling parameters for streaming (vLLM's example: max_tokens=100)
    sampling_params = SamplingParams(
        max_tokens=24,
        temperature=0.8,
        top_p=0.95,
        seed=42,  # For reproducible results
        output_kind=RequestOutputKind.DELTA,  # Get only new tokens each iteration
    )

    async for output in engine.generate(request_id=request_id, prompt=prompt, sampling_params=sampling_params):
        for completion in output.outputs:
            new_text = completion.text
            if new_text:
                print(new_text, end="", flush=True)
            check("delta", prompt, completion.text, completion.token_ids)

        if output.finished:
            print("Generation complete!")
            break


async def main():
    # vLLM's example: AsyncEngineArgs(model=..., enforce_eager=True); here sized for a CPU
    engine_args = AsyncEngineArgs(
        model="meta-llama/Llama-3.2-1B-Instruct",
        enforce_eager=True,  # Faster startup for examples
        max_model_len=512,
        max_num_seqs=8,
    )
    engine = AsyncLLM.from_engine_args(engine_args)

    try:
        prompts = [
            "The future of artificial intelligence is",
            "In a galaxy far, far away",
        ]
        for i, prompt in enumerate(prompts, 1):
            await stream_response(engine, prompt, f"stream-example-{i}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
'''

IMPORTS = {  # vLLM's v1 module paths, and where micro-vLLM keeps the same classes
    "from vllm.v1.metrics.reader import": "from micro_vllm.metrics.reader import",
    "from vllm.v1.engine.async_llm import": "from micro_vllm.engine.async_llm import",
    "from vllm": "from micro_vllm",
}


@pytest.fixture(scope="module")
def model_dir():
    try:
        return str(default_model_path())
    except DefaultModelUnavailable as e:
        pytest.skip(f"default model unavailable: {e}")


def run_script(script: str, model_dir: str, monkeypatch, argv: list[str] = ()) -> dict[str, list]:
    for theirs, ours in IMPORTS.items():
        script = script.replace(theirs, ours)
    script = script.replace(VLLM_MODEL, model_dir)
    records: dict[str, list] = {}

    def check(kind, *values):
        records.setdefault(kind, []).append(values[0] if len(values) == 1 else values)

    monkeypatch.setattr(sys, "argv", ["vllm_example.py", *argv])
    namespace = {"check": check, "__name__": "__main__"}
    exec(compile(script, "vllm_example.py", "exec"), namespace)
    return records


@pytest.fixture(scope="module")
def generate_run(model_dir, tmp_path_factory):
    """What the generate script saw; its LLM, left open, gives the other tests their expected outputs."""
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    with pytest.MonkeyPatch.context() as monkeypatch:
        seen = run_script(GENERATE_SCRIPT, model_dir, monkeypatch, [*SIZE_FLAGS, "--max_tokens", "8", "--temperature",
                                                                    "0", "--chat-template-path", str(template)])
    [llm] = seen.pop("llm")
    yield seen, llm
    llm.shutdown()


@pytest.fixture(scope="module")
def llm(generate_run):
    return generate_run[1]


def test_generate_and_chat_from_a_parsed_command_line(generate_run, llm):
    seen = generate_run[0]
    generated = dict(seen["generate"])
    assert len(generated) == 4 and all(1 <= len(ids) <= 8 for ids in generated.values())
    expected = llm.generate(list(generated), greedy_params(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in expected] == list(generated.values())  # greedy: what generate gives
    [(chat_prompt, chat_text, chat_ids)] = seen["chat"]
    assert chat_prompt.startswith("<|im_start|>system\nYou are a helpful assistant") and "Paris" in chat_text
    assert seen["chat_batch"] == [[chat_ids] * 3]
    [(template_prompt, template_ids)] = seen["chat_template"]
    assert template_prompt == ("<system>You are a helpful assistant<user>Hello<assistant>Hello! How can I assist "
                               "you today?<user>What is the capital of France?<assistant>")
    metrics = {m.name: m for m in seen["metric"] if "finished_reason" not in m.labels}
    all_ids = [*generated.values(), chat_ids, *[chat_ids] * 3, template_ids]
    assert metrics["vllm:generation_tokens"].value == sum(map(len, all_ids))
    assert metrics["vllm:request_generation_tokens"].count == len(all_ids)
    assert metrics["vllm:num_requests_running"].value == 0
    assert metrics["vllm:e2e_request_latency_seconds"].count == len(all_ids)


def test_llm_engine_example(model_dir, llm, monkeypatch):
    seen = run_script(LLM_ENGINE_SCRIPT, model_dir, monkeypatch, SIZE_FLAGS)
    assert seen["tokenizer"][0] is not None
    finished = {output.request_id: output for output in seen["finished"]}
    assert sorted(finished) == ["0", "1", "2"]
    greedy = finished["0"]
    [expected] = llm.generate("A robot may not injure a human being", greedy_params(16), use_tqdm=False)
    assert greedy.outputs[0].token_ids == expected.outputs[0].token_ids
    assert len(greedy.outputs[0].logprobs) == len(greedy.outputs[0].token_ids)
    assert len(greedy.prompt_logprobs) == len(greedy.prompt_token_ids)
    assert [c.index for c in finished["2"].outputs] == [0, 1]  # n=2


def test_async_llm_streaming(model_dir, llm, monkeypatch):
    from micro_vllm import SamplingParams

    seen = run_script(ASYNC_SCRIPT, model_dir, monkeypatch)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=42)
    prompts = ["The future of artificial intelligence is", "In a galaxy far, far away"]
    # Seeded: the same tokens, here in one batch (a seeded draw does not depend on its batch).
    for prompt, expected in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        deltas = [(text, ids) for p, text, ids in seen["delta"] if p == prompt]
        assert len(deltas) > 1  # streamed, not given at once
        assert [t for _, ids in deltas for t in ids] == expected.outputs[0].token_ids
        assert "".join(text for text, _ in deltas) == expected.outputs[0].text


def greedy_params(max_tokens: int):
    from micro_vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0)
