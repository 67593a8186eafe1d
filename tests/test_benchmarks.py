"""The benchmark scripts' own logic on CPU, so a change to the engine cannot silently break them
(they run only on request, mostly on the GPU machine)."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import pytest
import torch

from micro_vllm import LLM, SamplingParams
from micro_vllm.sampling import sampler as sampler_module
from micro_vllm.worker.step_output import DeviceStepOutput
from helpers.tiny_models import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu  # noqa: E402
import floor  # noqa: E402
import sampler_bench  # noqa: E402
import scheduler_bench  # noqa: E402
import throughput  # noqa: E402


@pytest.mark.parametrize("enable_caching", [True, False])
def test_scheduler_bench_runs_a_workload_to_the_end(enable_caching, tmp_path):
    workload = [(list(range(1 + i, 40 + 7 * i)), 5 + i) for i in range(12)]
    times = scheduler_bench.run_once(workload, enable_caching, make_tiny_model("qwen3", tmp_path))
    num_steps = len(times.schedule_ns)
    assert num_steps >= max(n for _, n in workload)  # a step per token of the longest
    assert len(times.prepare_ns) == len(times.update_ns) == num_steps
    assert times.prefill[0] and not times.full_decode[0]
    assert any(times.full_decode) and not any(p and d for p, d in zip(times.prefill, times.full_decode))


def test_throughput_phase_timers_count_every_step_and_unwrap(tmp_path):
    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [[1 + i] * (5 + 9 * i) for i in range(6)]
    max_tokens = [3 + 2 * i for i in range(6)]
    with throughput.time_phases(llm) as phases:
        tokens, *_ = throughput.run_micro_vllm(llm, prompts, max_tokens, temperature=0.6)
    assert tokens == sum(max_tokens)
    steps = phases["step_calls"]
    assert steps > 0 and all(phases[name + "_calls"] == steps for name in ("schedule", "execute"))
    # Every launched step's output is read and applied once; non-empty steps prepare, run and sample.
    assert phases["get_output_calls"] == phases["update_calls"] == steps
    assert 0 < phases["prepare_calls"] == phases["forward_calls"] == phases["sample_calls"] <= steps
    assert sum(phases[kind + "_calls"] for kind in throughput.STEP_KINDS) == steps
    assert phases["with prefill_calls"] > 0 and phases["decodes 1-15_calls"] > 0
    # The waits for the GPU are split over the kinds of step, each within its steps' time.
    assert sum(phases[kind + "_wait"] for kind in throughput.STEP_KINDS) == pytest.approx(phases["get_output"])
    assert all(0 <= phases[kind + "_wait"] <= phases[kind] for kind in throughput.STEP_KINDS)
    engine = llm.engine
    runner = engine.executor.worker.model_runner
    # Unwrapped: no instance attribute shadows a method any more.
    assert "step" not in vars(engine)
    assert not {"schedule", "update_from_output"} & set(vars(engine.scheduler))
    assert "execute_model" not in vars(engine.executor)
    assert not {"prepare_inputs", "run_model", "sample"} & set(vars(runner))
    assert DeviceStepOutput.get_output.__qualname__ == "DeviceStepOutput.get_output"


def test_collector_pauses_counts_each_generation_and_unhooks():
    callbacks = list(gc.callbacks)
    with throughput.collector_pauses() as pauses:
        gc.collect()
        gc.collect(0)
        gc.collect(0)
    gc.collect()  # after the block: not counted
    assert [pauses[g][0] for g in range(3)] == [2, 0, 1]
    assert all(seconds > 0 for count, seconds in pauses.values() if count)
    assert gc.callbacks == callbacks


def test_every_timed_run_starts_from_an_empty_prefix_cache(tmp_path):
    """A second timed run of the same prompts computes them again: the first run's cached blocks
    would otherwise serve them and flatter the figure. Within a run, a shared prefix is served."""
    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=128, block_size=16)
    distinct = [[1 + i] * 40 for i in range(3)]
    assert [throughput.run_micro_vllm(llm, distinct, [2, 2, 2], temperature=0.6)[2] for _ in range(2)] == [0, 0]
    shared = [[7] * 32 + [1 + i] * 5 for i in range(3)]  # two shared blocks, computed once
    assert [throughput.run_micro_vllm(llm, shared, [2, 2, 2], temperature=0.6)[2] for _ in range(2)] == [64, 64]


def test_latency_times_each_batch_and_its_first_steps(tmp_path):
    """latency.py's measurement: TTFT and TPOT of a batch from its own steps, the wall time of its
    first steps, and no allocation counted without CUDA."""
    import latency

    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=128, block_size=16,
              max_num_batched_tokens=32)
    row = latency.measure(llm, batch_size=3, prompt_len=20, output_len=4)
    # 60 prompt tokens over a 32-token budget: two prefill steps, then the decodes.
    assert len(row["first_steps_ms"]) == 4 and all(ms > 0 for ms in row["first_steps_ms"])
    assert 0 < row["tpot_ms"] and sum(row["first_steps_ms"][:2]) <= row["ttft_ms"] + 1e-6
    assert (row["device_allocs"], row["pinned_allocs"]) == (0, 0)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_option_reaches_every_request(tmp_path):
    """``--sampling-params`` JSON is merged over the recipe's SamplingParams; anything but a JSON
    object is refused by the parser."""
    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=64)
    generate, outputs = llm.generate, []
    llm.generate = lambda *args, **kwargs: outputs.extend(generate(*args, **kwargs)) or outputs
    extra = throughput.json_object('{"logprobs": 2, "top_k": 5, "temperature": 0}')
    assert throughput.run_micro_vllm(llm, [[1, 2, 3], [4, 5]], [3, 2], 0.6, extra)[0] == 5
    assert [len(o.outputs[0].logprobs) for o in outputs] == [3, 2]
    assert all(len(position) in (2, 3) for o in outputs for position in o.outputs[0].logprobs)
    params = throughput.recipe_params(4, 0.6, extra)
    assert (params.max_tokens, params.temperature, params.top_k, params.logprobs) == (4, 0, 5, 2)
    assert params.ignore_eos
    for bad in ("[1]", "logprobs=5"):
        with pytest.raises(argparse.ArgumentTypeError, match="JSON"):
            throughput.json_object(bad)


def test_profile_steps_profiles_the_window_it_is_asked_for(tmp_path):
    """Skipping one step of a run whose budget chunks the prompts profiles two prefill steps (the
    step stats tell them apart), and the wrapper the caller had on the engine's step is back after."""
    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=8)
    prefill_tokens = []
    step = llm.engine.step

    def counting_step():
        result = step()
        prefill_tokens.append(llm.engine.last_step_stats.num_prefill_tokens)
        return result

    llm.engine.step = counting_step
    # 8 prompts of 24 tokens take 6 prefill steps of 32 tokens; with the decodes after them the run
    # does not end on a 3-step cycle boundary, where a repeating profiler schedule reports empty.
    table = throughput.profile_steps(llm, [[5 + i] * 24 for i in range(8)], 0.6, skip_steps=1, steps=2)
    profiler_steps = [line.split()[-1] for line in table.splitlines() if line.strip().startswith("ProfilerStep")]
    assert profiler_steps == ["2"]  # exactly the two steps asked for
    assert "aten::" in table  # operators were recorded
    assert all(n > 0 for n in prefill_tokens[1:3])  # the profiled steps 2 and 3 prefill
    assert llm.engine.step == counting_step  # the caller's own wrapper is back


def test_cpu_benchmark_counts_the_same_useful_tokens_on_both_sides(tmp_path):
    """Both sides run the same greedy prompts (transformers left-padded) and count tokens up to and
    including the first EOS; a token that micro-vLLM's first output makes at its 4th step serves as EOS."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama", tmp_path)
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="sdpa", max_model_len=128)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[1 + i] * (3 + 5 * i) for i in range(4)]  # different lengths: transformers pads them
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)[0]
    eos = {first.outputs[0].token_ids[3]}
    # --single ignores EOS on both sides, so both make and count exactly the tokens asked for
    assert cpu.run_micro_vllm(llm, prompts, 12, eos, ignore_eos=True)[0] == 4 * 12
    assert cpu.run_transformers(model, prompts, 12, eos, pad_token_id=0, ignore_eos=True)[0] == 4 * 12
    ours, _ = cpu.run_micro_vllm(llm, prompts, 12, eos)
    theirs, _ = cpu.run_transformers(model, prompts, 12, eos, pad_token_id=0)
    assert ours == theirs < 4 * 12
    assert cpu.useful_tokens([5, 7, 9, 7], {7}) == 2 and cpu.useful_tokens([5, 6], {7}) == 2


def test_gpu_busy_counts_overlapping_intervals_once():
    from types import SimpleNamespace

    def event(start, end, device="CUDA", annotation=False):
        return SimpleNamespace(device_type=getattr(torch.autograd.DeviceType, device), is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    # kernels over [0, 10], [5, 20] (overlapping), [30, 40]: 30 us busy of a 40 us span; CPU ops and
    # the profiler's step annotation on the GPU are ignored
    events = [event(30, 40), event(0, 10), event(5, 20), event(-100, 500, "CPU"), event(-5, 45, annotation=True)]
    assert throughput.gpu_busy(events) == "GPU busy: 0.03 ms of a 0.04 ms span (75.0%)"
    assert throughput.gpu_busy(events[3:]) == "GPU busy: no GPU activity recorded"


def test_results_table_has_a_row_per_measurement():
    import json

    import results_table

    throughput_line = json.dumps({
        "benchmark": "throughput", "enforce_eager": False, "custom_ops": ["none", "+sampler"],
        "runs": [{"tok_per_s": 14279, "output_tokens": 133966, "seconds": 9.382, "steps": 1033}],
        "compare_transformers": {"requests": 16, "output_tokens": 2048, "seconds": 14.654},
    })
    latency_line = json.dumps({"benchmark": "latency", "prompt_len": 512, "output_len": 128,
                               "rows": [{"batch_size": 1, "run": 0, "ttft_ms": 17.8, "tpot_ms": 1.791},
                                        {"batch_size": 1, "run": 1, "ttft_ms": 9.1, "tpot_ms": 1.702}]})
    sweep_line = json.dumps({"benchmark": "attention_sweep", "rows": [
        {"batch": "decode", "tiles": {"block_m": 16, "tile_n": 64, "num_warps": 8, "num_stages": 3},
         "ms": 0.2, "TB/s": 3.0, "max_abs_diff": 0.0},
        {"batch": "decode 64", "tiles": {"block_m": 16, "tile_n": 128, "num_warps": 4, "num_stages": 3},
         "splits": 2, "ms": 0.1, "TB/s": 2.5, "max_abs_diff": 0.0}]})
    fp8_sweep_line = json.dumps({"benchmark": "attention_sweep", "kv_cache_dtype": "fp8", "rows": [
        {"batch": "decode 256", "tiles": {"block_m": 16, "tile_n": 128, "num_warps": 4, "num_stages": 3},
         "ms": 0.24, "TB/s": 2.4, "max_abs_diff": 0.0}]})
    gemm_line = json.dumps({"benchmark": "gemm_shapes", "rows": [
        {"blas": "cublas", "batch": 8, "matmul": "o_proj", "per_step": 28, "us": 4.0, "weight_TB/s": 1.05},
        {"blas": "cublas", "batch": 8, "matmul": "lm_head", "per_step": 1, "us": 90.0, "weight_TB/s": 3.46}]})
    table = results_table.results_table([throughput_line, latency_line, sweep_line, fp8_sweep_line,
                                          gemm_line]).splitlines()
    assert table[2] == "| throughput | --custom-ops=none,+sampler | 14,279 output tok/s (133,966 tokens in 9.382 s, 1,033 steps) |"
    assert table[3].startswith("| transformers, 16 requests | same process | 140 output tok/s")
    assert table[4] == "| latency | batch 1, prompt 512, output 128 | TTFT 17.8 ms, TPOT 1.79 ms |"
    assert table[5] == "| latency | batch 1, prompt 512, output 128, run 2 | TTFT 9.1 ms, TPOT 1.70 ms |"
    assert table[6] == "| attention sweep | decode: 16 x 64 tiles, 8 warps, 3 stages, auto splits | 200.0 us, 3.00 TB/s |"
    assert table[7] == "| attention sweep | decode 64: 16 x 128 tiles, 4 warps, 3 stages, 2 splits | 100.0 us, 2.50 TB/s |"
    assert table[8] == ("| attention sweep (fp8 KV cache) | decode 256: 16 x 128 tiles, 4 warps, 3 stages, "
                        "auto splits | 240.0 us, 2.40 TB/s |")
    assert table[9] == ("| gemm shapes | cublas, batch 8 | 202 us per step: o_proj 4.0 us (1.05 TB/s), "
                        "lm_head 90.0 us (3.46 TB/s) |")
    assert len(table) == 10


def test_attention_sweep_reads_decode_tiles_and_batches_from_the_command_line():
    import attention_sweep as sweep

    assert sweep.decode_tiles("128x4x3,64x2x3,128x4x3x168") == [
        sweep.Tiles(16, 128, 4, 3, True), sweep.Tiles(16, 64, 2, 3, True), sweep.Tiles(16, 128, 4, 3, True, max_registers=168)]
    for bad in ("128x4", "128x4x0", "64xfourx3", "128x4x3x168x2"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            sweep.decode_tiles(bad)
    assert sweep.decode_batches("20x8000-8511,8x800-800") == [(20, 8000, 8511), (8, 800, 800)]
    for bad in ("20x8000", "20-8000-8511", "0x800-900", "20x900-800", "20x8e3-9000"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            sweep.decode_batches(bad)


def test_attention_sweep_forces_each_tile_shape_and_keeps_the_outputs(monkeypatch):
    """The sweep's step builder, forced tile shapes and split counts, under the interpreter on a
    small step: a decode batch and a mixed one, each forced setting launched as asked and giving the
    backend's own outputs."""
    import attention_sweep as sweep
    from micro_vllm.attention.backends import triton_attn

    kernel, launches = triton_attn._attention_kernel, []

    class RecordingKernel:  # what each attention launch was given
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_attn, "_attention_kernel", RecordingKernel())

    def launched_tiles():
        k = launches[-1]
        return (k["BLOCK_M"], k["TILE_N"], k["num_warps"], k["num_stages"], k["ONE_QBLOCK_PER_REQ"], k["STEP_KV_TMA"],
                k["maxnreg"])

    pick = triton_attn._pick_tiles
    for query_lens, context_lens, tiles in (([1, 1, 1], [20, 45, 3], sweep.Tiles(16, 64, 4, 3, True)),
                                            ([40, 1], [0, 30], sweep.PREFILL_TILES[1]),
                                            ([40, 1], [0, 30], sweep.LONG_PREFILL_TILES[1])):
        step = sweep.make_step(query_lens, context_lens, "cpu", dtype=torch.float32)
        expected = sweep.attend(step, None)
        assert launched_tiles() != tuple(tiles)  # the forced shape is not the default one
        forced = sweep.attend(step, tiles)
        assert launched_tiles() == tuple(tiles)
        assert triton_attn._pick_tiles is pick  # restored
        torch.testing.assert_close(forced, expected, atol=1e-4, rtol=1e-4)
    split = sweep.attend(step := sweep.make_step([1, 1], [700, 90], "cpu", dtype=torch.float32), None, 2)
    assert launches[-1]["NUM_SPLITS"] == 2
    assert triton_attn._num_splits.__name__ == "_num_splits"  # restored
    torch.testing.assert_close(split, sweep.attend(step, None), atol=1e-4, rtol=1e-4)

    # --kv-cache-dtype fp8: the cache holds e4m3 values, and attention over it is attention over
    # those values widened (the step's new K/V too, which the launch rounds as the cache stores them).
    query, kv_cache, metadata, new_kv = sweep.make_step([1, 1], [40, 9], "cpu", dtype=torch.float32,
                                                        cache_dtype=torch.float8_e4m3fn)
    assert kv_cache.dtype == torch.float8_e4m3fn
    widened = (query, kv_cache.float(), metadata, new_kv.to(torch.float8_e4m3fn).float())
    torch.testing.assert_close(sweep.attend((query, kv_cache, metadata, new_kv), None), sweep.attend(widened, None),
                               atol=1e-4, rtol=1e-4)


def test_workloads_are_deterministic_pure_python_and_have_their_promised_shapes():
    import random
    import subprocess

    import workloads

    # The recipe is nano-vllm's draws after random.seed(0): prompts first, then output lengths.
    random.seed(0)
    nano_prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    recipe = workloads.make_workload("recipe")
    assert recipe.prompts == nano_prompts
    assert recipe.max_tokens == [random.randint(100, 1024) for _ in range(256)]

    shared = workloads.make_workload("shared-prefix")
    assert shared == workloads.make_workload("shared-prefix")  # the same requests on every call
    system_prompt = shared.prompts[0][:2000]
    assert len(shared.prompts) == len(shared.max_tokens) == 256
    assert all(p[:2000] == system_prompt for p in shared.prompts)
    assert len({tuple(p[2000:]) for p in shared.prompts}) == 256  # each its own suffix
    assert all(100 <= len(p) - 2000 <= 1024 for p in shared.prompts) and all(100 <= n <= 1024 for n in shared.max_tokens)

    long = workloads.make_workload("long-context")
    assert [len(p) for p in long.prompts] == [8000] * 32 and long.max_tokens == [512] * 32
    assert len({tuple(p) for p in long.prompts}) == 32
    prefill = workloads.make_workload("long-context-prefill")  # the same requests, one token out
    assert (prefill.prompts, prefill.max_tokens, prefill.max_model_len) == (long.prompts, [1] * 32, long.max_model_len)
    # json-schema: the recipe's prompts, each constrained to the schema, max_tokens only a cap.
    constrained = workloads.make_workload("json-schema")
    assert constrained.prompts == recipe.prompts and constrained.max_tokens == [1024] * 256
    assert constrained.json_schema is workloads.PRODUCT_SCHEMA
    assert all(w.json_schema is None for w in (recipe, shared, long, prefill))

    for w in (recipe, shared, long, constrained):
        assert all(len(p) + n <= w.max_model_len for p, n in zip(w.prompts, w.max_tokens))
        assert all(0 <= t <= 10000 for p in w.prompts for t in p)
    assert workloads.make_workload("shared-prefix", 3).prompts == shared.prompts[:3]
    with pytest.raises(ValueError, match="workload='chat'"):
        workloads.make_workload("chat")
    # The vLLM side imports it: it must need neither micro-vLLM nor torch.
    code = "import sys, workloads; assert not {'torch', 'micro_vllm'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(workloads.__file__).parent)


def fake_vllm(monkeypatch) -> list:
    """A stand-in ``vllm`` module (vLLM is not installed here) whose LLM records its calls."""
    import types

    calls = []

    class FakeEngine:
        """vLLM's LLMEngine loop: each step gives every unfinished request one more token."""

        def __init__(self):
            self.unfinished = {}

        def add_request(self, request_id, prompt, params):
            calls.append(("add", request_id, prompt["prompt_token_ids"], params))
            self.unfinished[request_id] = (params.max_tokens, [])

        def has_unfinished_requests(self):
            return bool(self.unfinished)

        def step(self):
            outputs = []
            for request_id, (max_tokens, token_ids) in list(self.unfinished.items()):
                token_ids.append(0)
                finished = len(token_ids) == max_tokens
                if finished:
                    del self.unfinished[request_id]
                outputs.append(types.SimpleNamespace(request_id=request_id, finished=finished,
                                                     outputs=[types.SimpleNamespace(token_ids=list(token_ids))]))
            return outputs

    class FakeLLM:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs))
            self.llm_engine = FakeEngine()

        def reset_prefix_cache(self):
            calls.append(("reset",))

        def generate(self, inputs, params, use_tqdm):
            assert len(inputs) == len(params) and not use_tqdm
            calls.append(("generate", [i["prompt_token_ids"] for i in inputs], params))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * p.max_tokens,
                                                                         finish_reason="length")],
                                          num_cached_tokens=None) for p in params]

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.__version__ = FakeLLM, types.SimpleNamespace, "0.24.0"
    fake.sampling_params = types.ModuleType("vllm.sampling_params")
    fake.sampling_params.StructuredOutputsParams = types.SimpleNamespace
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake.sampling_params)
    return calls


def test_vllm_workloads_runs_each_workload_from_an_empty_prefix_cache(monkeypatch, capsys):
    """One engine for all the workloads, sized for the longest; a warm-up, then every timed run after
    a prefix-cache reset; a RESULT line per run counting every requested token."""
    import json

    import vllm_workloads
    import workloads

    calls = fake_vllm(monkeypatch)
    vllm_workloads.main(["--model", "/m", "--workload", "long-context", "recipe", "--repeat", "2"])

    init = calls[0][1]
    assert (init["model"], init["dtype"], init["max_model_len"], init["skip_tokenizer_init"], init["seed"]) == (
        "/m", "bfloat16", 8512, True, 0)
    assert calls[1][0] == "generate" and len(calls[1][1]) == 1  # the warm-up
    timed = calls[2:]
    assert [c[0] for c in timed] == ["reset", "generate"] * 4
    long, recipe = workloads.long_context(), workloads.recipe()
    assert [c[1] for c in timed[1::2]] == [long.prompts, long.prompts, recipe.prompts, recipe.prompts]
    params = timed[-1][2]
    assert [p.max_tokens for p in params] == recipe.max_tokens
    assert all((p.temperature, p.ignore_eos, p.detokenize) == (0.6, True, False) for p in params)
    results = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()]
    assert results[0]["step"] == "vllm_start" and "error" in results[0]["config"]
    runs = [(r["workload"], r["run"], r["output_tokens"], r["cut_by_max_tokens"]) for r in results[1:]]
    assert runs == [("long-context", 1, 32 * 512, 32), ("long-context", 2, 32 * 512, 32),
                    ("recipe", 1, sum(recipe.max_tokens), 256), ("recipe", 2, sum(recipe.max_tokens), 256)]
    assert all(r["sampling"] == {} for r in results[1:])


def test_vllm_workloads_takes_throughputs_number_of_requests(monkeypatch, capsys):
    """``--num-requests`` gives vLLM the requests throughput.py's option gives micro-vLLM."""
    import json

    import vllm_workloads
    import workloads

    calls = fake_vllm(monkeypatch)
    vllm_workloads.main(["--model", "/m", "--workload", "long-context", "--num-requests", "24"])
    assert calls[3][1] == workloads.make_workload("long-context", 24).prompts == workloads.long_context(24).prompts
    results = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()]
    assert [(r["requests"], r["output_tokens"]) for r in results[1:]] == [(24, 24 * 512)]


def test_vllm_workloads_runs_each_sampling_setting_as_throughput_does(monkeypatch, capsys, tmp_path):
    """``--sampling-params``, repeatable, each a JSON object or a list of them: every workload runs
    under each setting in turn, its fields on every request over the recipe's (a seed becomes seed + i
    for request i); throughput.py gives micro-vLLM's requests the same fields. Anything but JSON
    objects is refused."""
    import json

    import vllm_workloads
    import workloads

    calls = fake_vllm(monkeypatch)
    top_p, seeded = {"top_p": 0.95}, {"seed": 7, "top_k": 50}
    vllm_workloads.main(["--model", "/m", "--workload", "recipe", "--sampling-params", json.dumps([top_p, seeded]),
                         "--sampling-params", '{"repetition_penalty": 1.1}'])
    generated = [c[2] for c in calls[2:] if c[0] == "generate"]
    assert len(generated) == 3
    assert all((p.top_p, p.temperature, p.ignore_eos) == (0.95, 0.6, True) for p in generated[0])
    assert [p.seed for p in generated[1]] == [7 + i for i in range(256)] and generated[1][5].top_k == 50
    assert all(p.repetition_penalty == 1.1 and not hasattr(p, "seed") for p in generated[2])
    results = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()]
    assert [r["sampling"] for r in results[1:]] == [top_p, seeded, {"repetition_penalty": 1.1}]

    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=64)
    generate, params = llm.generate, []
    llm.generate = lambda prompts, p, **kwargs: params.extend(p) or generate(prompts, p, **kwargs)
    throughput.run_micro_vllm(llm, [[1, 2], [3], [4, 5]], [2, 2, 2], 0.6, throughput.json_object(json.dumps(seeded)))
    assert [(p.seed, p.top_k, p.temperature) for p in params] == [(7, 50, 0.6), (8, 50, 0.6), (9, 50, 0.6)]
    for bad in ("[]", '[{"top_p": 0.9}, 2]', "top_p=0.9"):
        with pytest.raises(argparse.ArgumentTypeError, match="JSON"):
            workloads.sampling_settings(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="runs one"):
        throughput.json_object(json.dumps([top_p, seeded]))


def test_vllm_workloads_times_the_latency_batches_on_the_prompts_latency_py_takes(monkeypatch, capsys, tmp_path):
    """``--latency``: after latency.py's warm-up batch, batches of 1, 8 and 64 of latency.py's own
    prompts, greedy, 128 tokens each, added to vLLM's engine at once; a RESULT line per batch with the
    median TTFT and TPOT over all of its requests. latency.py draws the same prompts for micro-vLLM."""
    import json

    import latency
    import vllm_workloads
    import workloads

    calls = fake_vllm(monkeypatch)
    vllm_workloads.main(["--model", "/m", "--latency"])
    assert calls[0][1]["max_model_len"] == workloads.LATENCY_MAX_MODEL_LEN == 4096
    added = [c for c in calls if c[0] == "add"]
    batches = ((1, 16), (1, 512), (8, 512), (64, 512))  # the warm-up, then the timed ones
    expected = [prompt for size, length in batches for prompt in workloads.latency_prompts(size, length)]
    assert [prompt for _, _, prompt, _ in added] == expected
    timed = [params for _, _, prompt, params in added if len(prompt) == 512]
    assert all((p.temperature, p.max_tokens, p.ignore_eos, p.detokenize) == (0, 128, True, False) for p in timed)
    assert not [c for c in calls if c[0] == "generate" and len(c[1]) > 1]  # no throughput workload ran
    results = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()]
    timed_batches = [r for r in results if r["step"] == "vllm_latency"]
    assert [(r["batch_size"], r["requests"]) for r in timed_batches] == [(1, 1), (8, 8), (64, 64)]
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in timed_batches)

    llm = LLM(model=str(make_tiny_model("qwen3", tmp_path)), device="cpu", max_model_len=128)
    made = []
    make_request = llm.engine.make_request
    monkeypatch.setattr(llm.engine, "make_request", lambda *args: made.append(args[1]) or make_request(*args))
    latency.measure(llm, batch_size=2, prompt_len=12, output_len=3)
    assert made == workloads.latency_prompts(2, 12, max_token_id=min(10_000, llm.engine.vocab_size - 1))


def test_vllm_workloads_constrains_the_json_schema_workload_as_throughput_does(monkeypatch, capsys):
    """json-schema on vLLM: the engine loads the tokenizer and uses xgrammar, the warm-up compiles the
    schema, and every timed request is constrained to it and ends at EOS, with the fields throughput.py
    gives micro-vLLM's requests; the recipe in the same engine stays unconstrained, EOS ignored."""
    import json

    import vllm_workloads
    import workloads

    calls = fake_vllm(monkeypatch)
    vllm_workloads.main(["--model", "/m", "--workload", "json-schema", "recipe"])
    init = calls[0][1]
    assert (init["skip_tokenizer_init"], init["structured_outputs_config"], init["max_model_len"]) == (
        False, {"backend": "xgrammar"}, 4096)
    warm_up = calls[1][2]
    assert [p.ignore_eos for p in warm_up] == [True, False]
    assert warm_up[1].structured_outputs.json is workloads.PRODUCT_SCHEMA
    constrained, recipe = [c[2] for c in calls[2:] if c[0] == "generate"]
    ours = throughput.recipe_params(1024, 0.6, None, workloads.PRODUCT_SCHEMA)
    assert all((p.ignore_eos, p.max_tokens, p.temperature) == (ours.ignore_eos, 1024, 0.6) for p in constrained)
    assert all(p.structured_outputs.json is ours.structured_outputs.json for p in constrained)
    assert not ours.ignore_eos and all(p.ignore_eos and not hasattr(p, "structured_outputs") for p in recipe)
    results = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()]
    assert [(r["workload"], r["requests"]) for r in results[1:]] == [("json-schema", 256), ("recipe", 256)]


BENCH_VOCAB = 10_240  # past the workloads' token ids (up to 10,000) and the JSON pieces above them


@pytest.fixture(scope="module")
def small_bench_model(tmp_path_factory) -> Path:
    """The benchmark checkpoint as bench_model writes it (its tokenizer, its EOS), shrunk to one
    small layer and a vocabulary of BENCH_VOCAB."""
    from bench_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("bench-model"), num_hidden_layers=1, hidden_size=32,
                              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              vocab_size=BENCH_VOCAB)


def test_bench_tokenizer_keeps_its_words_and_has_what_json_needs(small_bench_model):
    """Below the JSON pieces every id is still the word t<i>, words joined by spaces (the other
    workloads' ids, the server benchmark's text); the last ids are JSON's pieces, then EOS, which is
    the model's EOS too. xgrammar reads every token as the text that decoding gives it."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from bench_model import EOS_TOKEN, JSON_PIECES

    tokenizer = AutoTokenizer.from_pretrained(small_bench_model)
    num_words = BENCH_VOCAB - len(JSON_PIECES) - 1
    assert tokenizer.decode([0, 5, 10_000]) == "t0 t5 t10000"
    assert tokenizer.encode("t0 t5 t10000", add_special_tokens=False) == [0, 5, 10_000]
    assert tokenizer.convert_ids_to_tokens(list(range(num_words, BENCH_VOCAB))) == [*JSON_PIECES, EOS_TOKEN]
    eos = BENCH_VOCAB - 1
    assert tokenizer.eos_token_id == eos and tokenizer.all_special_ids == [eos]
    assert json.loads((small_bench_model / "generation_config.json").read_text())["eos_token_id"] == eos
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=BENCH_VOCAB)
    decoded_vocab = info.decoded_vocab  # each token's text as xgrammar reads it (built on every access)
    # Every piece, and words spread over the vocabulary, after a piece: no space is dropped.
    ids = list(range(num_words, eos)) + list(range(0, num_words, 97))
    assert tokenizer.decode(ids) == b"".join(decoded_vocab[i] for i in ids).decode()
    assert info.stop_token_ids == [eos]


def test_json_schema_workload_ends_each_request_with_a_schema_valid_object(small_bench_model):
    """micro-vLLM on the CPU runs json-schema's first requests (seeded) on the shrunk benchmark
    checkpoint: each ends at EOS, where its object ends, long before max_tokens; its text is JSON
    that validates against the schema, and exactly the text of the tokens the grammar accepted."""
    import json

    import jsonschema
    import xgrammar as xgr

    import workloads

    workload = workloads.make_workload("json-schema", 3)
    llm = LLM(model=str(small_bench_model), device="cpu", dtype="float32", max_model_len=workload.max_model_len)
    generate, outputs = llm.generate, []
    llm.generate = lambda *args, **kwargs: outputs.extend(generate(*args, **kwargs)) or outputs
    tokens, _, _, cut = throughput.run_micro_vllm(llm, workload.prompts, workload.max_tokens, 0.6, {"seed": 0},
                                                  workload.json_schema)
    assert cut == 0 and tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
    decoded_vocab = xgr.TokenizerInfo.from_huggingface(llm.get_tokenizer(), vocab_size=BENCH_VOCAB).decoded_vocab
    eos = BENCH_VOCAB - 1
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and completion.token_ids[-1] == eos
        assert completion.text == b"".join(decoded_vocab[t] for t in completion.token_ids[:-1]).decode()
        jsonschema.validate(json.loads(completion.text), workload.json_schema)


def test_sampler_bench_times_every_case_on_cpu(capsys):
    """The smoke run times each case before and after; its "before" masks the same tokens as the
    engine's top-k / top-p on untied logits, so the two time the same filter."""
    results = sampler_bench.main(["--device", "cpu", "--rows", "8", "--vocab", "4096", "--iters", "1"])
    assert [r["case"] for r in results] == list(sampler_bench.CASES)
    assert all(r["before_ms"] > 0 and r["after_ms"] > 0 for r in results)
    assert "top_k=50 top_p=0.9" in capsys.readouterr().out
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(0))
    top_k, top_p = torch.tensor([0, 5, 50, 50], dtype=torch.int32), torch.tensor([1.0, 0.9, 0.9, 0.3])
    before = sampler_bench.sorted_top_k_top_p_threshold(logits, top_k, top_p)
    after = sampler_module.top_k_top_p_threshold(logits, top_k, top_p, 64, sampler_module.sorted_top_p_threshold)
    assert torch.equal(logits >= before, logits >= after)
    inverse_temperature = torch.full((4,), 1 / 0.6)  # as the Sampler passes it for rows with top-p alone
    scaled = logits * inverse_temperature.unsqueeze(-1)
    with_inverse_temperature = sampler_bench.sorted_top_k_top_p_threshold(logits, top_k, top_p, None, None,
                                                                          inverse_temperature)
    assert torch.equal(with_inverse_temperature, sampler_bench.sorted_top_k_top_p_threshold(scaled, top_k, top_p))


def test_peer_workloads_refuses_a_sampling_that_is_not_json_objects(tmp_path):
    """``SAMPLING`` goes through the scripts' own parser before anything runs."""
    import os
    import subprocess

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(["bash", "benchmarks/peer_workloads.sh", str(tmp_path)], cwd=root, capture_output=True,
                         text=True, env={**os.environ, "SAMPLING": "[1]", "OUT": str(tmp_path / "out")})
    assert run.returncode == 2 and "not a JSON object of SamplingParams fields" in run.stderr


# A model small enough to count by hand: per layer q, k, v, o 8x8, 8x4, 8x4, 8x8 (heads 2 and 1 of 4),
# gate, up, down 8x16 each; 2 layers; norms 8 + 8 + 4 + 4 a layer (Qwen3's q/k norms) and 8 at the end.
TINY_CONFIG = dict(model_type="qwen3", hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=4, vocab_size=32, tie_word_embeddings=True, dtype="bfloat16")


def tiny_floor(workload, kv_cache_dtype="auto", bandwidth_tbs=1e-12, tflops=1e-12):
    """At 1 byte and 1 FLOP a second, the seconds are the bytes and the FLOPs."""
    return floor.floor(workload, floor.ModelShape.from_config(TINY_CONFIG), kv_cache_dtype, bandwidth_tbs, tflops)


def test_floor_counts_a_tiny_workload_by_hand():
    # Request 1: 3 prompt tokens, 2 outputs; request 2: 5 and 4. No common prefix.
    result = tiny_floor(floor.Workload([[1, 2, 3], [4, 5, 6, 7, 8]], [2, 4], max_model_len=16))
    kv_token_bytes = 2 * 1 * 4 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
    # Decodes read every earlier token: request 1's output 2 reads 3; request 2's outputs 2, 3, 4 read 5, 6, 7.
    assert result["kv_read_bytes"] == (3 + 5 + 6 + 7) * kv_token_bytes
    assert result["kv_written_bytes"] == (3 + 1 + 5 + 3) * kv_token_bytes  # prompts and fed outputs
    params = 2 * (64 + 32 + 32 + 64 + 3 * 128) + 32 * 8 + 2 * 24 + 8
    assert result["steps"] == 4 and result["weight_bytes"] == 4 * params * 2
    # 12 tokens through 1,152 layer weights, 6 sampled through the 256 of the LM head; attention pairs:
    # prefills 1+2+3 and 1+...+5, decodes 4 and 6, 7, 8, each 2 x 2 FLOPs a head's value, 2 heads of 4, 2 layers.
    assert result["linear_flops"] == 2 * (1152 * 12 + 256 * 6)
    assert result["attention_flops"] == 4 * 2 * 2 * 4 * (6 + 4 + 15 + 6 + 7 + 8)
    memory = result["kv_read_bytes"] + result["kv_written_bytes"] + result["weight_bytes"]
    assert (result["memory_s"], result["compute_s"]) == pytest.approx((memory, 30720 + 2944))
    assert result["floor_s"] == result["compute_s"] and result["ceiling_tok_per_s"] == pytest.approx(6 / 33664)
    fast = tiny_floor(floor.Workload([[1, 2, 3], [4, 5, 6, 7, 8]], [2, 4], 16), tflops=1.0)
    assert fast["floor_s"] == fast["memory_s"] == pytest.approx(memory)
    # An fp8 cache halves the K/V bytes and nothing else.
    fp8 = tiny_floor(floor.Workload([[1, 2, 3], [4, 5, 6, 7, 8]], [2, 4], 16), kv_cache_dtype="fp8")
    assert (2 * fp8["kv_read_bytes"], 2 * fp8["kv_written_bytes"]) == (result["kv_read_bytes"], result["kv_written_bytes"])
    assert (fp8["weight_bytes"], fp8["linear_flops"], fp8["attention_flops"]) == (
        result["weight_bytes"], result["linear_flops"], result["attention_flops"])


def test_a_shared_prefix_is_written_once_and_read_once_a_step():
    """Two requests opening with the same 4 tokens, beside the same lengths without the common prefix:
    each request's reads of its own tokens and its decodes' attention are the same; the prefix is
    prefilled once instead of twice and read once a decode step instead of once per decoding request."""
    max_tokens = [3, 2]
    shared = tiny_floor(floor.Workload([[9, 9, 9, 9, 1, 2], [9, 9, 9, 9, 3]], max_tokens, 16))
    apart = tiny_floor(floor.Workload([[8, 9, 9, 9, 1, 2], [9, 9, 9, 9, 3]], max_tokens, 16))
    kv_token_bytes = 32
    assert apart["kv_read_bytes"] == ((6 + 7) + 5) * kv_token_bytes
    assert shared["kv_read_bytes"] == apart["kv_read_bytes"] - 4 * (2 + 1 - 2) * kv_token_bytes
    assert shared["kv_written_bytes"] == apart["kv_written_bytes"] - 4 * kv_token_bytes
    assert shared["linear_flops"] == apart["linear_flops"] - 2 * 1152 * 4
    assert shared["attention_flops"] == apart["attention_flops"] - 4 * 2 * 2 * 4 * (1 + 2 + 3 + 4)


def test_latency_floor_counts_a_tiny_batch_by_hand():
    """Two prompts of 3 tokens, 3 output tokens each: TTFT is the prefill step's floor, TPOT the mean of
    the two decode steps', each step the larger of its bytes and FLOPs (at 1 a second, as above)."""
    model = floor.ModelShape.from_config(TINY_CONFIG)
    compute_bound = floor.latency_floor(2, model, "auto", 1e-12, 1e-12, prompt_len=3, output_len=3)
    weight_bytes, kv_token_bytes = 1464 * 2, 32
    # Prefill: 6 tokens through the layers, 2 through the LM head, pairs 1 + 2 + 3 a prompt; 6 K/V written.
    prefill_flops, prefill_bytes = 2 * (1152 * 6 + 256 * 2) + 64 * 2 * 6, weight_bytes + 6 * kv_token_bytes
    # Output k = 2, 3: each request reads 3 + k - 2 tokens' K/V, writes one, attends over 3 + k - 1.
    decode_flops = [2 * 2 * (1152 + 256) + 64 * 2 * (3 + k - 1) for k in (2, 3)]
    decode_bytes = [weight_bytes + 2 * (3 + k - 1) * kv_token_bytes for k in (2, 3)]
    assert compute_bound["ttft_floor_ms"] == pytest.approx(1000 * prefill_flops)
    assert compute_bound["tpot_floor_ms"] == pytest.approx(1000 * sum(decode_flops) / 2)
    memory_bound = floor.latency_floor(2, model, "auto", 1e-12, 1.0, prompt_len=3, output_len=3)
    assert memory_bound["ttft_floor_ms"] == pytest.approx(1000 * prefill_bytes)
    assert memory_bound["tpot_floor_ms"] == pytest.approx(1000 * sum(decode_bytes) / 2)


def test_floor_reproduces_the_documented_recipe_and_long_context_figures(capsys):
    """docs/benchmarks.md's floors at 4.19 TB/s, from the script's command line."""
    import json

    results = {r["workload"]: r for r in floor.main(["--workload", "recipe", "long-context", "--measured", "recipe=25316"])}
    recipe, long = results["recipe"], results["long-context"]
    assert round((recipe["kv_read_bytes"] + recipe["kv_written_bytes"]) / 1e12, 1) == 13.9
    assert (round(recipe["weight_bytes"] / 1e12, 2), round(recipe["floor_s"], 1)) == (1.22, 3.6)
    assert 37_000 < recipe["ceiling_tok_per_s"] < 38_000 and round(recipe["of_ceiling"], 2) == 0.68
    assert round((long["kv_read_bytes"] + long["kv_written_bytes"]) / 1e12, 1) == 15.5
    assert (round(long["weight_bytes"] / 1e12, 1), round(long["floor_s"], 1)) == (0.6, 3.8)
    out = capsys.readouterr().out
    assert "| recipe | 133,966 | 1,024 | 13.84 + 0.03 | 1.22 |" in out and "| 25,316 | 68% |" in out
    assert [json.loads(line[len("RESULT "):])["workload"] for line in out.splitlines() if line.startswith("RESULT ")] == [
        "recipe", "long-context"]
    latency = floor.main(["--workload", "latency"])
    assert [r["batch_size"] for r in latency] == [1, 8, 64]
    # Batch 1 reads the weights (1.19 GB) and little K/V a decode; its prefill is compute-bound.
    assert (round(latency[0]["tpot_floor_ms"], 2), round(latency[0]["ttft_floor_ms"], 2)) == (0.30, 0.62)
    assert "| 1 | 512 / 128 | 0.62 | 0.300 |" in capsys.readouterr().out
    for bad in (["--measured", "recipe=fast"], ["--measured", "chat=10"], ["--workload", "recipe", "--measured",
                                                                             "long-context=3000"]):
        with pytest.raises(SystemExit):
            floor.main(bad)


@pytest.mark.parametrize("script, first_log", [("peer_workloads.sh", "vllm_workloads.log"),
                                                ("peer_serving.sh", "vllm_server.log")])
def test_the_peer_scripts_stop_when_the_extra_wheels_do_not_install(tmp_path, script, first_log):
    """``EXTRA_WHEELS`` is installed (benchmarks/peer_env.sh) before either engine runs; a folder that
    installs nothing stops the run there, with pip's message."""
    import os
    import subprocess

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "wheels").mkdir()
    env = {**os.environ, "EXTRA_WHEELS": str(tmp_path / "wheels"), "EXTRA_SITE": str(tmp_path / "site"),
           "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", f"benchmarks/{script}", str(tmp_path)], cwd=root, capture_output=True,
                         text=True, env=env)
    assert run.returncode == 7 and "EXTRA_WHEELS failed" in run.stdout, run.stdout + run.stderr
    assert not (tmp_path / "out" / first_log).exists()


def test_peer_serving_checks_its_engines_and_the_checkpoint_before_starting_a_server(tmp_path):
    """An engine name it does not know stops the run before anything is set up; so does a folder
    without a checkpoint, once the environment is (no server log is written)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OUT": str(tmp_path / "out"), "ENGINES": "vllm sglang"}
    env.pop("EXTRA_WHEELS", None)
    env.pop("VLLM_DIR", None)
    run = subprocess.run(["bash", "benchmarks/peer_serving.sh", str(tmp_path)], cwd=root, capture_output=True,
                         text=True, env=env)
    assert run.returncode == 2 and "'sglang' is none of vllm, ours" in run.stdout, run.stdout + run.stderr
    assert not (tmp_path / "out").exists()
    run = subprocess.run(["bash", "benchmarks/peer_serving.sh", str(tmp_path)], cwd=root, capture_output=True,
                         text=True, env={**env, "ENGINES": "ours"})
    assert run.returncode == 3 and f"no checkpoint in {tmp_path}" in run.stdout, run.stdout + run.stderr
    assert list((tmp_path / "out").iterdir()) == []



def test_output_bench_streams_a_delta_to_every_request_each_step(monkeypatch):
    """output_bench's requests stream deltas: each step gives every request one output with its one
    new token and that token's word, none stopped; a step without new tokens gives none."""
    import tempfile

    import output_bench
    from bench_model import save_word_tokenizer
    from transformers import AutoTokenizer

    from micro_vllm.engine.output_processor import OutputProcessor

    with tempfile.TemporaryDirectory() as directory:
        save_word_tokenizer(Path(directory), output_bench.VOCAB_SIZE)
        processor = OutputProcessor(AutoTokenizer.from_pretrained(directory))
    requests = output_bench.streaming_requests(processor, num_requests=3, max_tokens=8)
    steps = []
    process_step = processor.process_step
    monkeypatch.setattr(processor, "process_step", lambda ids: steps.append(process_step(ids)) or steps[-1])
    assert len(output_bench.time_steps(processor, requests, num_steps=2)) == 2
    for step, (outputs, _) in enumerate(steps):
        assert [output.request_id for output in outputs] == [request.request_id for request in requests]
        for output, request in zip(outputs, requests):
            token_id = request.output_token_ids[step]
            (completion,) = output.outputs
            assert (completion.token_ids, completion.text.strip()) == ([token_id], f"t{token_id}")
    assert process_step([r.request_id for r in requests]) == ([], [])
