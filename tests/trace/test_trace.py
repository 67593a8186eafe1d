"""The structured trace (events per step, sinks, block-level events, the trace commands) and abort
through LLM, on a tiny random model on CPU."""

import json
import threading
from pathlib import Path

import pytest

from micro_vllm import LLM, SamplingParams
from micro_vllm.cli import main
from micro_vllm.trace import TraceConfig
from micro_vllm.trace.tools import format_summary, read_trace, summarize, to_chrome_trace
from helpers.tiny_models import make_tiny_model
from helpers.trace import ListSink

SHARED = list(range(10, 34))  # three full blocks of 8, shared by every prompt
PROMPTS = [SHARED + [40 + i] * (3 + 2 * i) for i in range(6)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
STEP_KEYS = {
    "event": str, "step": int, "time": float, "duration": float, "num_running": int, "num_waiting": int,
    "num_scheduled_tokens": int, "num_prefill_tokens": int, "num_decode_tokens": int, "requests": list,
    "kv_total_blocks": int, "kv_free_blocks": int, "kv_cached_blocks": int, "prefix_cache_hit_tokens": int,
    "prefix_cache_query_tokens": int, "preempted": list, "finished": list,
}
BLOCK_EVENTS = {"allocated", "hit", "freed", "cached", "evicted"}
END_KEYS = {
    "event": str, "step": int, "time": float, "kv_total_blocks": int, "kv_free_blocks": int, "kv_used_blocks": int,
    "kv_cached_blocks": int, "num_running": int, "num_waiting": int,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("trace"))


def _llm(model_dir, trace=None, **overrides) -> LLM:
    # A small cache and a small token budget: chunked prefill, prefix hits and (with few blocks) preemption.
    settings = dict(max_model_len=64, block_size=8, max_num_batched_tokens=32, max_num_seqs=4, num_blocks=40)
    settings.update(overrides)
    return LLM(model=str(model_dir), device="cpu", dtype="float32", trace=trace, **settings)


def _steps(events):
    return [e for e in events if e["event"] == "step"]


def _run(model_dir, trace, prompts=PROMPTS, **overrides):
    with _llm(model_dir, trace, **overrides) as llm:
        return llm.generate(prompts, GREEDY, use_tqdm=False)


def test_off_by_default(model_dir):
    with _llm(model_dir) as llm:
        assert llm.engine.tracer is None
        assert llm.engine.scheduler.kv_cache_manager.block_pool.listener is None
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)


def test_the_block_pool_has_a_listener_only_at_block_level(model_dir):
    with _llm(model_dir, TraceConfig(ListSink(), level="step")) as llm:
        assert llm.engine.scheduler.kv_cache_manager.block_pool.listener is None
    with _llm(model_dir, TraceConfig(ListSink(), level="block")) as llm:
        assert llm.engine.scheduler.kv_cache_manager.block_pool.listener is llm.engine.tracer


def test_one_event_per_step_with_the_schema(model_dir):
    sink = ListSink()
    outputs = _run(model_dir, sink, num_blocks=200)  # a roomy cache: no preemption
    start, *rest, end = sink.events
    assert start["event"] == "start" and start["kv_total_blocks"] == 199 and start["block_size"] == 8
    steps = _steps(rest)
    assert len(steps) == len(rest)  # level "step" writes nothing else
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for step in steps:
        for key, kind in STEP_KEYS.items():
            assert isinstance(step[key], kind), (key, step[key])
        assert sum(r["tokens"] for r in step["requests"]) == step["num_scheduled_tokens"] <= 32
        assert step["num_prefill_tokens"] + step["num_decode_tokens"] == step["num_scheduled_tokens"]
        decode = sum(r["tokens"] for r in step["requests"] if r["kind"] == "decode")
        assert decode == step["num_decode_tokens"] and all(r["tokens"] == 1 for r in step["requests"]
                                                            if r["kind"] == "decode")
        assert 0 <= step["kv_free_blocks"] <= step["kv_total_blocks"] and step["duration"] >= 0
    assert all(a["time"] + a["duration"] <= b["time"] for a, b in zip(steps, steps[1:]))
    finished = [rid for s in steps for rid in s["finished"]]
    assert sorted(finished) == sorted(o.request_id for o in outputs)
    # Without preemption, every prompt token is either a prefix hit or prefilled once, and every
    # output token but the last is decoded once.
    hits = sum(s["prefix_cache_hit_tokens"] for s in steps)
    assert hits == sum(o.num_cached_tokens for o in outputs) > 0
    assert sum(s["num_prefill_tokens"] for s in steps) == sum(len(p) for p in PROMPTS) - hits
    assert sum(s["num_decode_tokens"] for s in steps) == sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    assert sum(s["prefix_cache_query_tokens"] for s in steps) == sum(len(p) for p in PROMPTS)
    # The trace ends when the LLM shuts down, with the cache after the last frees: nothing held,
    # the prefixes still cached.
    for key, kind in END_KEYS.items():
        assert isinstance(end[key], kind), (key, end[key])
    assert end["event"] == "end" and end["step"] == len(steps) and end["time"] >= steps[-1]["time"]
    assert end["kv_used_blocks"] == 0 and end["kv_free_blocks"] == end["kv_total_blocks"] == 199
    assert end["kv_cached_blocks"] >= 3 and end["num_running"] == end["num_waiting"] == 0


def test_jsonl_path_and_emit_object_write_the_same_events(model_dir, tmp_path):
    sink = ListSink()
    _run(model_dir, sink)
    for path in (str(tmp_path / "a.jsonl"), tmp_path / "b.jsonl"):
        llm = _llm(model_dir, path)
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        from_file = read_trace(path)  # readable before shutdown: the file is line buffered
        assert _without_times(from_file) == _without_times(sink.events[:-1])
        llm.shutdown()  # writes the end event
        assert _without_times(read_trace(path)) == _without_times(sink.events)
        assert sink.events[-1]["event"] == "end"


def _without_times(events):
    return [{k: v for k, v in e.items() if k not in ("time", "duration", "unix_time")} for e in events]


def test_block_events_only_at_block_level(model_dir):
    step_level, block_level = ListSink(), ListSink()
    outputs = _run(model_dir, TraceConfig(step_level, level="step"))
    _run(model_dir, TraceConfig(block_level, level="block"))
    assert {e["event"] for e in step_level.events} == {"start", "step", "end"}
    blocks = [e for e in block_level.events if e["event"] in BLOCK_EVENTS]
    assert {e["event"] for e in blocks} >= {"allocated", "freed", "cached"}
    request_ids = {o.request_id for o in outputs}
    num_steps = len(_steps(block_level.events))
    for event in blocks:
        assert event["request_id"] in request_ids and event["block_ids"] and 0 <= event["step"] < num_steps
        assert 0 not in event["block_ids"]  # the null block is never handed out
    # Replayed in order, the events keep every block's reference count: each block handed out or
    # reused comes back, and nothing is freed that no request held.
    holders = {}
    for event in blocks:
        for block_id in event["block_ids"]:
            if event["event"] in ("allocated", "hit"):
                assert event["event"] == "hit" or holders.get(block_id, 0) == 0, "allocated while held"
                holders[block_id] = holders.get(block_id, 0) + 1
            elif event["event"] == "freed":
                assert holders.get(block_id, 0) >= 1, f"block {block_id} freed but not held"
                holders[block_id] = 0  # freed means its last reference went
    assert not any(holders.values()), "a block was never freed"
    assert _steps(block_level.events) and _without_times(_steps(block_level.events)) == _without_times(
        _steps(step_level.events))


def test_a_prefix_cache_reset_evicts_every_cached_block_in_one_event(model_dir):
    """``reset_prefix_cache`` between two calls: one ``evicted`` event, for no request, names exactly
    the blocks the cache held, and the second call starts with no cached block."""
    sink = ListSink()
    with _llm(model_dir, TraceConfig(sink, level="block")) as llm:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        cached = {b.block_id for b in llm.engine.scheduler.kv_cache_manager.block_pool.blocks if b.block_hash}
        assert cached and llm.reset_prefix_cache()
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    resets = [e for e in sink.events if e["event"] == "evicted" and e["request_id"] is None]
    assert len(resets) == 1 and set(resets[0]["block_ids"]) == cached
    first_step_after = next(e for e in _steps(sink.events) if e["step"] == resets[0]["step"])
    assert first_step_after["prefix_cache_hit_tokens"] == 0


def test_hit_events_name_the_reused_prefix_blocks(model_dir):
    """The prompts share three full blocks: every request admitted after the first reuses them, and
    its hit event names the blocks the first request cached, as many as the step's hit tokens say."""
    sink = ListSink()
    _run(model_dir, TraceConfig(sink, level="block"))
    events = sink.events
    first_cached = [b for e in events if e["event"] == "cached" and e["request_id"] == "0" for b in e["block_ids"]][:3]
    hits = [e for e in events if e["event"] == "hit"]
    assert {e["request_id"] for e in hits} == {str(i) for i in range(1, len(PROMPTS))}
    assert all(e["block_ids"] == first_cached for e in hits)
    steps = _steps(events)
    for step in steps:
        hit_blocks = sum(len(e["block_ids"]) for e in hits if e["step"] == step["step"])
        assert step["prefix_cache_hit_tokens"] == 8 * hit_blocks


@pytest.mark.parametrize(
    "trace, error, match",
    [
        (42, TypeError, r"trace=42 is not allowed; give a JSON-lines path"),
        ("", TypeError, r"trace='' is not allowed"),
        (object(), TypeError, r"emit\(event\)"),
    ],
)
def test_bad_trace_values_fail_before_loading(trace, error, match):
    with pytest.raises(error, match=match):
        LLM(model="/no/such/model", trace=trace)  # the trace is checked before the model is looked for


def test_bad_trace_level_names_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match=r"trace level='blocks' is not allowed; choose one of \('step', 'block'\)"):
        TraceConfig(tmp_path / "t.jsonl", level="blocks")
    with pytest.raises(TypeError, match=r"trace sink=3"):
        TraceConfig(3)


@pytest.fixture(scope="module")
def preempted_trace(model_dir, tmp_path_factory):
    """A JSON-lines trace of a run whose cache is too small for the batch, so requests get preempted."""
    path = tmp_path_factory.mktemp("preempt") / "run.jsonl"
    outputs = _run(model_dir, str(path), num_blocks=12, max_num_seqs=6)
    return path, outputs


def test_summarize_matches_the_events(preempted_trace, capsys):
    path, outputs = preempted_trace
    steps = _steps(read_trace(path))
    preemptions = sum(len(s["preempted"]) for s in steps)
    assert preemptions > 0
    [summary] = summarize(read_trace(path))
    assert summary.preemptions == preemptions
    assert summary.steps == len(steps) and summary.finished == len(outputs)
    assert summary.prefill_tokens == sum(s["num_prefill_tokens"] for s in steps)
    assert summary.decode_tokens == sum(s["num_decode_tokens"] for s in steps)
    assert summary.peak_kv_blocks_used == max(s["kv_total_blocks"] - s["kv_free_blocks"] for s in steps) == 11

    assert main(["trace", "summarize", str(path), "--json"]) == 0
    [figures] = json.loads(capsys.readouterr().out)
    hits, queries = (sum(s[k] for s in steps) for k in ("prefix_cache_hit_tokens", "prefix_cache_query_tokens"))
    assert figures["prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    assert figures["preemptions"] == preemptions and figures["peak_kv_usage"] == 1.0

    assert main(["trace", "summarize", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"preemptions        {preemptions}\n" in text
    assert f"steps              {len(steps)}\n" in text
    assert "peak KV use        11 / 11 blocks (100.0%)" in text
    end = read_trace(path)[-1]
    assert summary.end_kv_blocks_used == 0 and summary.end_unfinished == 0
    assert summary.end_kv_cached_blocks == end["kv_cached_blocks"] > 0
    assert f"KV at end          0 / 11 blocks in use, {end['kv_cached_blocks']} cached, 0 requests unfinished\n" in text
    [without_end] = summarize(read_trace(path)[:-1])  # an engine that was not shut down
    assert without_end.end_kv_blocks_used is None and "not recorded" in format_summary(without_end)


def test_the_end_event_shows_blocks_still_held_at_shutdown(model_dir):
    sink = ListSink()
    with _llm(model_dir, sink) as llm:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        llm.engine.scheduler.kv_cache_manager.block_pool.get_new_blocks(2)  # held by no request, as a leak would be
    end = sink.events[-1]
    assert end["event"] == "end" and end["kv_used_blocks"] == 2 and end["num_running"] == end["num_waiting"] == 0
    [summary] = summarize(sink.events)
    assert "2 / 39 blocks in use" in format_summary(summary) and "a leak" in format_summary(summary)


def test_plot_writes_a_png(preempted_trace, tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = preempted_trace
    out = tmp_path / "run.png"
    assert main(["trace", "plot", str(path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_writes_chrome_trace_events(preempted_trace, tmp_path):
    path, outputs = preempted_trace
    out = tmp_path / "trace.json"
    assert main(["trace", "export", str(path), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    steps = _steps(read_trace(path))
    step_slices = [e for e in events if e["ph"] == "X" and e["name"].startswith("step ")]
    assert len(step_slices) == len(steps)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")
    assert {e["name"] for e in events if e["ph"] == "C"} == {"KV blocks", "requests", "tokens"}
    instants = [e["name"] for e in events if e["ph"] == "i"]
    assert sum(n.startswith("finish ") for n in instants) == len(outputs)
    assert sum(n.startswith("preempt ") for n in instants) == sum(len(s["preempted"]) for s in steps)
    # One track per request, each slice a run of prefill or decode steps.
    request_slices = [e for e in events if e["ph"] == "X" and e["name"] in ("prefill", "decode")]
    assert {e["tid"] for e in request_slices} == set(range(1, len(outputs) + 1))
    assert sum(e["args"]["tokens"] for e in request_slices) == sum(s["num_scheduled_tokens"] for s in steps)


def test_trace_commands_report_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "step"}\nnot json\n')
    assert main(["trace", "summarize", str(bad)]) == 2
    assert "bad.jsonl:2 is not a JSON object" in capsys.readouterr().err
    assert main(["trace", "summarize", str(tmp_path / "missing.jsonl")]) == 2


class AbortAt:
    """A trace sink that aborts requests from inside generate(), as a user callback would."""

    def __init__(self, llm_box: list, at_step: int, request_ids: list[str]) -> None:
        self.llm_box, self.at_step, self.request_ids = llm_box, at_step, request_ids
        self.events: list[dict] = []
        self.accepted: list[bool] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)
        if event["event"] == "step" and event["step"] == self.at_step:
            self.accepted = [self.llm_box[0].abort_request(rid) for rid in self.request_ids]


def test_abort_through_llm(model_dir):
    expected = _run(model_dir, None)
    box: list = []
    # Request "1" is running at step 2; with max_num_seqs=2, request "5" has not started yet.
    sink = AbortAt(box, at_step=2, request_ids=["1", "5", "nope"])
    llm = _llm(model_dir, TraceConfig(sink, level="block"), max_num_seqs=2)
    box.append(llm)
    assert llm.abort_request("0") is False  # nothing in flight
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sink.accepted == [True, True, False]
    running, waiting = outputs[1], outputs[5]
    assert running.outputs[0].finish_reason == waiting.outputs[0].finish_reason == "abort"
    assert 0 < len(running.outputs[0].token_ids) < GREEDY.max_tokens
    assert running.outputs[0].token_ids == expected[1].outputs[0].token_ids[: len(running.outputs[0].token_ids)]
    assert waiting.outputs[0].token_ids == []
    for i in (0, 2, 3, 4):  # the others complete unchanged
        assert outputs[i].outputs[0].finish_reason == "length"
        assert outputs[i].outputs[0].token_ids == expected[i].outputs[0].token_ids
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    aborts = [e for e in sink.events if e["event"] == "abort"]
    assert [(e["request_id"], e["step"]) for e in aborts] == [("1", 3), ("5", 3)]
    freed_at_abort = [e for e in sink.events if e["event"] == "freed" and e["request_id"] == "1" and e["step"] == 3]
    assert freed_at_abort  # its blocks went back before step 3 ran
    assert llm.abort_request("1") is False  # finished
    llm.shutdown()


def test_aborting_every_request_ends_generate(model_dir):
    box: list = []
    sink = AbortAt(box, at_step=0, request_ids=[str(i) for i in range(len(PROMPTS))])
    with _llm(model_dir, sink) as llm:
        box.append(llm)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outputs] == ["abort"] * len(PROMPTS)
        assert len(_steps(sink.events)) == 1  # no step runs once nothing is left
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks


def test_abort_from_another_thread(model_dir):
    started = threading.Event()

    class Signal(ListSink):
        def emit(self, event: dict) -> None:
            super().emit(event)
            if event["event"] == "step":
                started.set()

    llm = _llm(model_dir, Signal(), max_num_seqs=2)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    aborter = threading.Thread(target=lambda: started.wait(30) and llm.abort_request("0"))
    aborter.start()
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    aborter.join()
    assert outputs[0].outputs[0].finish_reason == "abort" and len(outputs[0].outputs[0].token_ids) < 40
    assert [o.outputs[0].finish_reason for o in outputs[1:]] == ["length", "length"]
    llm.shutdown()


def test_generate_cli_writes_a_trace(model_dir, tmp_path, capsys):
    path = tmp_path / "cli.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--prompt", "hello", "--max-tokens", "3",
                 "--device", "cpu", "--no-chat", "--trace", str(path), "--trace-level", "block"]) == 0
    events = read_trace(path)
    assert sum(len(s["finished"]) for s in _steps(events)) == 2
    assert any(e["event"] == "allocated" for e in events)
    assert to_chrome_trace(events)["traceEvents"]
