"""vLLM's offline interface, piece by piece on tiny models: ``EngineArgs`` and its command line,
``LLMEngine``'s request loop, ``load_format="dummy"``, ``hf_overrides``, default sampling parameters
from ``generation_config.json``, chat template options, ``get_metrics``, the tensor-parallel refusal,
and an engine that leaves the process' global random generators alone.
(``test_vllm_offline_examples.py`` runs vLLM's own example scripts on the default model.)"""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from micro_vllm import LLM, CacheConfig, EngineArgs, LLMConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from micro_vllm.config import ParallelConfig
from micro_vllm.cli import main
from micro_vllm.entrypoints.openai import api_server
from micro_vllm.metrics.reader import Counter, Gauge, Histogram
from micro_vllm.model_loader.checkpoint import default_sampling_overrides, load_hf_config, load_model
from micro_vllm.utils import FlexibleArgumentParser
from helpers.tiny_models import make_tiny_model, one_torch_thread  # noqa: F401

SETTINGS = dict(device="cpu", max_model_len=64, block_size=8)
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("offline")))


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model=model, **SETTINGS) as llm:
        yield llm


def parse(argv: list[str]):
    parser = FlexibleArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser
    return parser.parse_args(argv)


# -- EngineArgs and the command line -----------------------------------------------------------


def test_every_config_field_is_an_engine_arg_with_its_default():
    args = {f.name: f for f in dataclasses.fields(EngineArgs)}
    for cls in (ModelConfig, SchedulerConfig, CacheConfig, ParallelConfig):
        for config_field in dataclasses.fields(cls):
            if config_field.name != "model":  # required in ModelConfig; None (the default model) here
                assert args[config_field.name].default == config_field.default, config_field.name
    assert args["trace"].default is None and "trace" in {f.name for f in dataclasses.fields(LLMConfig)}


def test_flags_parse_into_engine_args_and_its_config():
    args = parse(["--model", "m", "--max_model_len", "128", "--no-enable-prefix-caching", "--enforce-eager",
                  "--hf-overrides", '{"rope_theta": 5.0}', "--custom-ops=-rms_norm,+sampler", "--load_format=dummy",
                  "--dtype", "float32", "-tp", "1", "--trust-remote-code"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs(model="m", max_model_len=128, enable_prefix_caching=False, enforce_eager=True,
                                     hf_overrides={"rope_theta": 5.0}, custom_ops=["-rms_norm", "+sampler"],
                                     load_format="dummy", dtype="float32", trust_remote_code=True)
    config = engine_args.create_engine_config()
    assert config.model_config == ModelConfig(model="m", enforce_eager=True, hf_overrides={"rope_theta": 5.0},
                                              custom_ops=("-rms_norm", "+sampler"), load_format="dummy",
                                              dtype="float32")
    assert config.scheduler_config == SchedulerConfig(max_model_len=128)
    assert config.cache_config == CacheConfig(enable_prefix_caching=False)
    assert EngineArgs.from_cli_args(parse([])) == EngineArgs()


def test_settings_of_unbuilt_features_are_refused(model, capsys):
    with pytest.raises(TypeError, match=r"does not build: enable_lora \(LoRA adapters\)"):
        LLM(model=model, enable_lora=True)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['swap_space'\] for LLM"):
        LLM(model=model, swap_space=4)
    with pytest.raises(SystemExit):
        parse(["--enable-lora"])
    assert "unrecognized arguments: --enable-lora" in capsys.readouterr().err
    assert main(["serve", "m", "-tp", "0"]) == 2
    assert "tensor_parallel_size=0 is not allowed" in capsys.readouterr().err


def test_serve_takes_the_model_as_an_argument_or_a_flag(monkeypatch):
    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda config, names, *args, **kwargs: calls.append((config, names)) or 0)
    assert main(["serve", "--model", "some/model", "--max_num_seqs", "3"]) == 0
    assert main(["serve", "other/model", "--model", "ignored"]) == 0
    [(first, first_names), (second, second_names)] = calls
    assert (first.model_config.model, first.scheduler_config.max_num_seqs, first_names) == ("some/model", 3,
                                                                                            ["some/model"])
    assert (second.model_config.model, second_names) == ("other/model", ["other/model"])


# -- LLMEngine -------------------------------------------------------------------------------


def test_llm_engine_add_step_loop_gives_what_generate_gives(model, llm):
    """vLLM's llm_engine_example: one request added per step, steps until none is unfinished."""
    prompts = [([5, 6, 7], GREEDY), ("hello", SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4)),
               ({"prompt_token_ids": [9, 8]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))]
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **SETTINGS))
    assert engine.get_tokenizer() is not None
    pending, finished, request_id = list(prompts), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending:
            prompt, params = pending.pop(0)
            engine.add_request(str(request_id), prompt, params)
            request_id += 1
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    expected = llm.generate([p for p, _ in prompts], [sp for _, sp in prompts], use_tqdm=False)
    assert sorted(finished) == ["0", "1", "2"]
    for index, want in enumerate(expected):
        got = finished[str(index)]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    engine.shutdown()


def test_llm_engine_request_surface(llm):
    engine = llm.engine
    with pytest.raises(TypeError, match=r"request_id=7 is not allowed; it must be a string"):
        engine.add_request(7, [1, 2], GREEDY)
    request = engine.make_request("made", [1, 2], GREEDY)
    with pytest.raises(ValueError, match=r"request_id='other' is not the id"):
        engine.add_request("other", request)
    engine.add_request("made", request)
    engine.add_request("second", [3, 4], GREEDY)
    aborted = engine.abort_request(["made", "second", "unknown"])
    assert [(o.request_id, o.outputs[0].finish_reason) for o in aborted] == [("made", "abort"), ("second", "abort")]
    assert not engine.has_unfinished_requests() and engine.abort_request("made") == []


# -- load_format="dummy" and hf_overrides --------------------------------------------------------


def test_dummy_weights_have_the_checkpoints_shapes_and_come_from_the_seed(model, tmp_path):
    path = make_tiny_model("qwen3", tmp_path)
    hf_config = load_hf_config(path)
    cpu = torch.device("cpu")
    # bf16: on CPU, fp32 linear weights take oneDNN's layout, which unties the head and reads no values.
    real = dict(load_model(path, hf_config, torch.bfloat16, cpu).named_parameters())
    (path / "model.safetensors").unlink()  # dummy weights need no weight files

    def dummy(seed):
        return dict(load_model(path, hf_config, torch.bfloat16, cpu, load_format="dummy", seed=seed).named_parameters())

    first, again, other = dummy(3), dummy(3), dummy(4)
    assert {n: (p.shape, p.dtype) for n, p in first.items()} == {n: (p.shape, p.dtype) for n, p in real.items()}
    assert all(0 < p.abs().max() <= 1e-3 for p in first.values())
    assert all(torch.equal(first[n], again[n]) and not torch.equal(first[n], other[n]) for n in real)
    with pytest.raises(ValueError, match=r"has no \*.safetensors weights"):
        load_model(path, hf_config, torch.float32, cpu)


def test_dummy_engine_with_hf_overrides_runs_without_weight_files(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    (path / "model.safetensors").unlink()
    with LLM(model=str(path), load_format="dummy", hf_overrides={"num_hidden_layers": 1}, **SETTINGS) as llm:
        assert len(llm.engine.executor.get_attention_specs()) == 1  # the checkpoint's config has 2
        [out] = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5


def test_hf_overrides_as_a_dict_or_a_function(model):
    assert load_hf_config(model, {"max_position_embeddings": 48, "new_field": 1}).max_position_embeddings == 48

    def shorter(config):
        config.max_position_embeddings = 40
        return config

    assert load_hf_config(model, shorter).max_position_embeddings == 40
    with pytest.raises(TypeError, match=r"returned NoneType; it must return a transformers PretrainedConfig"):
        load_hf_config(model, lambda config: None)
    with pytest.raises(ValueError, match=r"hf_overrides=\['max_position_embeddings'\] is not allowed"):
        ModelConfig(model=model, hf_overrides=["max_position_embeddings"])


# -- default sampling parameters ------------------------------------------------------------------


def test_default_sampling_params_come_from_generation_config(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    recommended = {"temperature": 0.0, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3,
                   "max_new_tokens": 6, "do_sample": True, "eos_token_id": 257, "typical_p": None}
    (path / "generation_config.json").write_text(json.dumps(recommended))
    expected = SamplingParams(temperature=0.0, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3, max_tokens=6)
    with LLM(model=str(path), **SETTINGS) as llm:
        assert llm.get_default_sampling_params() == expected
        prompts = [[1, 2, 3, 1, 2, 3], "abc"]  # no params: the model's defaults, as in vLLM
        assert ([o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
                == [o.outputs[0].token_ids for o in llm.generate(prompts, expected, use_tqdm=False)])
    assert default_sampling_overrides(path, "vllm") == {}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert default_sampling_overrides(path, str(elsewhere)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match=r"generation_config='/no/such/dir' is not allowed"):
        LLM(model=str(path), generation_config="/no/such/dir", **SETTINGS)


# -- chat templates ---------------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}{% if signature %}[{{ signature }}]{% endif %}")


def test_chat_template_options(llm):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    one_token = SamplingParams(max_tokens=1)

    def prompt(**options):
        [out] = llm.chat(conversation, one_token, use_tqdm=False, chat_template=TEMPLATE, **options)
        assert out.prompt_token_ids == list(out.prompt.encode())  # the tiny tokenizer: one token per byte
        return out.prompt

    with pytest.raises(ValueError, match=r"no chat template; pass chat_template"):
        llm.chat(conversation, one_token, use_tqdm=False)
    assert prompt() == "user: hi\nassistant: The answer is\nassistant:"
    assert prompt(add_generation_prompt=False) == "user: hi\nassistant: The answer is\n"
    assert prompt(add_generation_prompt=False, continue_final_message=True) == "user: hi\nassistant: The answer is"
    assert prompt(chat_template_kwargs={"signature": "x"}).endswith("assistant:[x]")
    with pytest.raises(ValueError, match=r"continue_final_message=True is not allowed with add_generation_prompt"):
        llm.chat(conversation, one_token, chat_template=TEMPLATE, continue_final_message=True)
    with pytest.raises(TypeError, match=r"chat_template_kwargs=\['x'\] is not allowed"):
        llm.chat(conversation, one_token, chat_template=TEMPLATE, chat_template_kwargs=["x"])


# -- metrics ------------------------------------------------------------------------------------------


def test_get_metrics_reads_what_the_runs_recorded(model, llm):
    args = parse(["--model", model, "--device", "cpu", "--max-model-len", "64", "--block-size", "8"])
    with LLM(**vars(args)) as recording:  # vLLM's generate.py: the parsed flags as keywords (stats on)
        outputs = recording.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=4, ignore_eos=True),
                                     use_tqdm=False)
        outputs += recording.generate([[6]], SamplingParams(max_tokens=3, stop_token_ids=[]), use_tqdm=False)
        metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in recording.get_metrics()}
    labels = (("engine", "0"), ("model_name", model))
    sequences = [(len(o.prompt_token_ids), c) for o in outputs for c in o.outputs]
    generated = sum(len(c.token_ids) for _, c in sequences)
    counters = {name: m.value for (name, _), m in metrics.items() if isinstance(m, Counter)}
    assert counters["vllm:prompt_tokens"] == sum(n for n, _ in sequences) == 2 * 3 + 2 * 2 + 1
    assert counters["vllm:generation_tokens"] == generated
    reasons = [c.finish_reason for _, c in sequences]
    for reason in set(reasons):
        success = metrics["vllm:request_success", tuple(sorted((("finished_reason", reason), *labels)))]
        assert success.value == reasons.count(reason)
    assert counters["vllm:prefix_cache_queries"] >= 6  # every prompt token was looked up
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert isinstance(metrics[name, labels], Gauge) and metrics[name, labels].value == 0  # left idle
    tokens = metrics["vllm:request_generation_tokens", labels]
    assert isinstance(tokens, Histogram) and (tokens.count, tokens.sum) == (5, generated)
    assert tokens.buckets["+Inf"] == 5 and tokens.buckets["2.0"] == 0
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds",
                 "vllm:time_to_first_token_seconds", "vllm:request_params_max_tokens"):
        assert metrics[name, labels].count == 5, name  # one a sequence
    assert metrics["vllm:inter_token_latency_seconds", labels].count == generated - 5  # each token after the first
    assert metrics["vllm:request_params_max_tokens", labels].sum == 2 * 2 * 4 + 3
    n = metrics["vllm:request_params_n", labels]
    assert (n.count, n.sum) == (3, 2 + 2 + 1)  # one a request, its sequences together
    steps = metrics["vllm:iteration_tokens_total", labels]
    assert steps.sum == counters["vllm:prompt_tokens"] + generated
    with pytest.raises(RuntimeError, match=r"disable_log_stats=False"):
        llm.get_metrics()  # off by default, as in vLLM's LLM


# -- no global side effects -----------------------------------------------------------------------------


def test_the_engine_seed_leaves_the_global_generators_alone(model):
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    before = random.getstate(), np.random.get_state(), torch.get_rng_state()
    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)  # unseeded: the engine's generator
    runs = []
    for seed in (5, 5, 6):
        with LLM(model=model, seed=seed, **SETTINGS) as llm:
            runs.append(llm.generate([[1, 2, 3]], sampled, use_tqdm=False)[0].outputs[0].token_ids)
    after = random.getstate(), np.random.get_state(), torch.get_rng_state()
    assert before[0] == after[0] and torch.equal(before[2], after[2])
    assert all(np.array_equal(a, b) for a, b in zip(before[1], after[1]))
    assert runs[0] == runs[1] != runs[2]
