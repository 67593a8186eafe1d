"""Reading a trace back: per-run summaries, a picture of the run, and Chrome trace export.

This module owns everything the ``micro-vllm trace`` commands do with a JSON-lines trace written by
``tracer.py`` (its events are defined in ``events.py``). A file may hold several runs (several
engines writing to one sink); each ``start`` event begins a new one. matplotlib is imported only by
``plot`` (the ``trace`` extra).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from micro_vllm.trace.events import EndEvent, StepEvent, TraceEvent

ChromeEvent = dict[str, Any]  # one event of the Chrome trace format


# -- reading -----------------------------------------------------------------------------------


def read_trace(path: str | Path) -> list[TraceEvent]:
    """The events of a JSON-lines trace; a bad line raises with its number."""
    events = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not a JSON object: {error}") from None
            if not isinstance(event, dict) or "event" not in event:
                raise ValueError(f"{path}:{number} is not a trace event (a JSON object with an 'event' key)")
            events.append(event)
    return events


def split_runs(events: list[TraceEvent]) -> list[list[TraceEvent]]:
    """One list per run: a ``start`` event opens a run; events before any start form one too."""
    runs: list[list[TraceEvent]] = []
    for event in events:
        if event["event"] == "start" or not runs:
            runs.append([])
        runs[-1].append(event)
    return runs


def _steps(run: list[TraceEvent]) -> list[StepEvent]:
    return [e for e in run if e["event"] == "step"]


# -- summarize ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    steps: int
    prefill_tokens: int
    decode_tokens: int
    wall_time_s: float  # first step's start to last step's end
    tokens_per_s: float  # (prefill + decode) / wall time
    finished: int
    aborted: int
    preemptions: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int  # tokens of requests as they were admitted (again after preemption)
    prefix_cache_hit_rate: float  # hits / queries
    kv_total_blocks: int
    peak_kv_blocks_used: int
    peak_kv_usage: float  # fraction of kv_total_blocks
    peak_running: int
    peak_waiting: int
    # From the ``end`` event; None when the run has none (its engine was not shut down).
    end_kv_blocks_used: int | None  # blocks still held at shutdown: above 0 with nothing unfinished, a leak
    end_kv_cached_blocks: int | None
    end_unfinished: int | None  # requests running or waiting at shutdown


def summarize(events: list[TraceEvent]) -> list[RunSummary]:
    return [_summarize_run(_steps(run), run) for run in split_runs(events)]


def _summarize_run(steps: list[StepEvent], run: list[TraceEvent]) -> RunSummary:
    prefill = sum(s["num_prefill_tokens"] for s in steps)
    decode = sum(s["num_decode_tokens"] for s in steps)
    wall = steps[-1]["time"] + steps[-1]["duration"] - steps[0]["time"] if steps else 0.0
    hits = sum(s["prefix_cache_hit_tokens"] for s in steps)
    queries = sum(s["prefix_cache_query_tokens"] for s in steps)
    total = next((e["kv_total_blocks"] for e in run if "kv_total_blocks" in e), 0)
    peak_used = max((s["kv_total_blocks"] - s["kv_free_blocks"] for s in steps), default=0)
    end = _end(run)
    return RunSummary(
        steps=len(steps),
        prefill_tokens=prefill,
        decode_tokens=decode,
        wall_time_s=wall,
        tokens_per_s=(prefill + decode) / wall if wall > 0 else 0.0,
        finished=sum(len(s["finished"]) for s in steps),
        aborted=sum(1 for e in run if e["event"] == "abort"),
        preemptions=sum(len(s["preempted"]) for s in steps),
        prefix_cache_hit_tokens=hits,
        prefix_cache_query_tokens=queries,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        kv_total_blocks=total,
        peak_kv_blocks_used=peak_used,
        peak_kv_usage=peak_used / total if total else 0.0,
        peak_running=max((s["num_running"] for s in steps), default=0),
        peak_waiting=max((s["num_waiting"] for s in steps), default=0),
        end_kv_blocks_used=end and end["kv_used_blocks"],
        end_kv_cached_blocks=end and end["kv_cached_blocks"],
        end_unfinished=end and end["num_running"] + end["num_waiting"],
    )


def _end(run: list[TraceEvent]) -> EndEvent | None:
    return next((e for e in run if e["event"] == "end"), None)


def format_summary(summary: RunSummary) -> str:
    s = summary
    rows = [
        ("steps", f"{s.steps}"),
        ("tokens", f"{s.prefill_tokens + s.decode_tokens} ({s.prefill_tokens} prefill, {s.decode_tokens} decode)"),
        ("wall time", f"{s.wall_time_s:.3f} s"),
        ("throughput", f"{s.tokens_per_s:.1f} tokens/s"),
        ("requests", f"{s.finished} finished, {s.aborted} aborted"),
        ("preemptions", f"{s.preemptions}"),
        ("prefix cache hits", f"{s.prefix_cache_hit_tokens} / {s.prefix_cache_query_tokens} tokens "
                              f"({100 * s.prefix_cache_hit_rate:.1f}%)"),
        ("peak KV use", f"{s.peak_kv_blocks_used} / {s.kv_total_blocks} blocks ({100 * s.peak_kv_usage:.1f}%)"),
        ("peak batch", f"{s.peak_running} running, {s.peak_waiting} waiting"),
        ("KV at end", _format_end(s)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _format_end(s: RunSummary) -> str:
    if s.end_kv_blocks_used is None:
        return "not recorded (no end event: the engine was not shut down)"
    text = (f"{s.end_kv_blocks_used} / {s.kv_total_blocks} blocks in use, {s.end_kv_cached_blocks} cached, "
            f"{s.end_unfinished} requests unfinished")
    if s.end_kv_blocks_used and not s.end_unfinished:
        text += " (blocks held with no request left: a leak)"
    return text


# -- plot --------------------------------------------------------------------------------------

_PREFILL, _DECODE, _USED, _CACHED = "#4C72B0", "#DD8452", "#55A868", "#8172B2"
_PREEMPT, _FINISH, _DONE = "#C44E52", "#7F7F7F", "#937860"


def plot(events: list[TraceEvent], out: str | Path) -> None:
    """Draw the last run of a trace: batch composition, KV blocks, and requests, step by step."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting a trace needs matplotlib: pip install 'micro-vllm[trace]'") from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    run = split_runs(events)[-1] if events else []
    steps = _steps(run)
    if not steps:
        raise ValueError("the trace has no step events to plot")
    fig, (tokens_ax, kv_ax, req_ax) = plt.subplots(
        3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.6]}
    )
    x = [s["step"] for s in steps]
    _plot_tokens(tokens_ax, x, steps, _start(run))
    _plot_kv(kv_ax, x, steps)
    _plot_requests(req_ax, x, steps)
    for ax in (tokens_ax, kv_ax, req_ax):
        _mark_events(ax, steps)
        ax.grid(axis="y", alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    req_ax.set_xlabel("engine step")
    req_ax.set_xlim(x[0] - 0.5, x[-1] + 0.5)
    fig.suptitle(_title(steps, run), fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _start(run: list[TraceEvent]) -> TraceEvent:
    return run[0] if run and run[0]["event"] == "start" else {}


def _title(steps: list[StepEvent], run: list[TraceEvent]) -> str:
    s = _summarize_run(steps, run)
    title = (f"{s.steps} steps, {s.prefill_tokens + s.decode_tokens} tokens, {s.finished} requests, "
             f"{s.preemptions} preemptions, prefix-cache hit rate {100 * s.prefix_cache_hit_rate:.0f}%")
    start = _start(run)
    if "block_size" in start:
        title += (f"\n{start['kv_total_blocks']} KV blocks of {start['block_size']} tokens, step budget "
                  f"{start['max_num_batched_tokens']} tokens / {start['max_num_seqs']} requests")
    return title


def _plot_tokens(ax, x: list[int], steps: list[StepEvent], start: TraceEvent) -> None:
    prefill = [s["num_prefill_tokens"] for s in steps]
    decode = [s["num_decode_tokens"] for s in steps]
    ax.bar(x, prefill, width=1.0, color=_PREFILL, label="prefill tokens", linewidth=0)
    ax.bar(x, decode, width=1.0, bottom=prefill, color=_DECODE, label="decode tokens", linewidth=0)
    if "max_num_batched_tokens" in start:
        ax.axhline(start["max_num_batched_tokens"], color="black", linestyle=":", linewidth=1,
                   label="token budget")
    ax.set_ylabel("tokens scheduled")
    ax.set_title("batch composition per step", loc="left", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    handles += [_line(_PREEMPT, "--"), _line(_FINISH, ":")]
    labels += ["preemption", "request finished"]
    ax.legend(handles, labels, loc="upper right", fontsize=8, ncol=3, framealpha=0.9)
    ax.set_ylim(0, max(max(p + d for p, d in zip(prefill, decode)), start.get("max_num_batched_tokens", 0)) * 1.3)


def _plot_kv(ax, x: list[int], steps: list[StepEvent]) -> None:
    total = steps[0]["kv_total_blocks"]
    used = [s["kv_total_blocks"] - s["kv_free_blocks"] for s in steps]
    ax.fill_between(x, used, step="mid", color=_USED, alpha=0.45, linewidth=0, label="blocks in use")
    ax.step(x, used, where="mid", color=_USED, linewidth=1.2)
    ax.step(x, [s["kv_cached_blocks"] for s in steps], where="mid", color=_CACHED, linewidth=1.5,
            label="blocks holding a prefix-cache hash")
    ax.axhline(total, color="black", linestyle=":", linewidth=1, label=f"capacity ({total} blocks)")
    ax.set_ylim(0, total * 1.25)
    ax.set_ylabel("KV blocks")
    ax.set_title("KV cache", loc="left", fontsize=10)
    ax.legend(loc="upper right", fontsize=8, ncol=3, framealpha=0.9)


def _plot_requests(ax, x: list[int], steps: list[StepEvent]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.step(x, [s["num_running"] for s in steps], where="mid", color="#222222", label="running")
    ax.step(x, [s["num_waiting"] for s in steps], where="mid", color="#999999", label="waiting")
    finished = list(itertools.accumulate(len(s["finished"]) for s in steps))
    ax.step(x, finished, where="post", color=_DONE, linewidth=1.5, label="finished (so far)")
    ax.set_ylabel("requests")
    ax.set_ylim(0, max(finished[-1], *(max(s["num_running"], s["num_waiting"]) for s in steps)) * 1.4 + 1)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    ax.legend(loc="upper right", fontsize=8, ncol=3, framealpha=0.9)


def _mark_events(ax, steps: list[StepEvent]) -> None:
    for s in steps:
        if s["finished"]:
            ax.axvline(s["step"], color=_FINISH, linestyle=":", linewidth=0.8, alpha=0.6, zorder=0)
        if s["preempted"]:
            ax.axvline(s["step"], color=_PREEMPT, linestyle="--", linewidth=0.9, alpha=0.8, zorder=3)


def _line(color: str, style: str):
    from matplotlib.lines import Line2D

    return Line2D([], [], color=color, linestyle=style)


# -- export ------------------------------------------------------------------------------------

_ENGINE_PID, _REQUEST_PID = 1, 2


def to_chrome_trace(events: list[TraceEvent]) -> dict[str, Any]:
    """Chrome trace event format (opens in Perfetto and chrome://tracing). Timestamps are in
    microseconds from the engine's start; each run of the file becomes its own pair of processes."""
    out: list[ChromeEvent] = []
    for index, run in enumerate(split_runs(events)):
        pid = 2 * index + _ENGINE_PID
        out += _metadata(pid, f"engine (run {index})", {0: "steps"})
        out += [e for step in _steps(run) for e in _step_events(step, pid)]
        out += [_instant(f"abort {e['request_id']}", e["time"], pid, {"step": e["step"]})
                for e in run if e["event"] == "abort"]
        end = _end(run)
        if end is not None:  # the KV counters end where the last frees left them
            out.append(_counter("KV blocks", end["time"], pid, {"in use": end["kv_used_blocks"],
                                                                "cached": end["kv_cached_blocks"]}))
        out += _request_tracks(_steps(run), pid + 1, index)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _metadata(pid: int, name: str, threads: dict[int, str]) -> list[ChromeEvent]:
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}]
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}
               for tid, thread in threads.items()]
    return events


def _instant(name: str, seconds: float, pid: int, args: dict[str, Any]) -> ChromeEvent:
    return {"ph": "i", "s": "p", "name": name, "ts": _us(seconds), "pid": pid, "tid": 0, "args": args}


def _counter(name: str, seconds: float, pid: int, values: dict[str, int]) -> ChromeEvent:
    return {"ph": "C", "name": name, "ts": _us(seconds), "pid": pid, "tid": 0, "args": values}


def _step_events(step: StepEvent, pid: int) -> Iterator[ChromeEvent]:
    t, end = step["time"], step["time"] + step["duration"]
    args = {k: step[k] for k in ("step", "num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting",
                                 "kv_free_blocks", "prefix_cache_hit_tokens")}
    yield {"ph": "X", "name": f"step {step['step']}", "ts": _us(t), "dur": _us(step["duration"]), "pid": pid,
           "tid": 0, "args": args}
    yield _counter("KV blocks", t, pid, {"in use": step["kv_total_blocks"] - step["kv_free_blocks"],
                                         "cached": step["kv_cached_blocks"]})
    yield _counter("requests", t, pid, {"running": step["num_running"], "waiting": step["num_waiting"]})
    yield _counter("tokens", t, pid, {"prefill": step["num_prefill_tokens"], "decode": step["num_decode_tokens"]})
    for request_id in step["preempted"]:
        yield _instant(f"preempt {request_id}", t, pid, {"step": step["step"]})
    for request_id in step["finished"]:
        yield _instant(f"finish {request_id}", end, pid, {"step": step["step"]})


def _request_tracks(steps: list[StepEvent], pid: int, run_index: int) -> list[ChromeEvent]:
    """One track per request: consecutive steps of the same kind merge into one prefill or decode slice."""
    tids: dict[str, int] = {}
    open_slices: dict[str, ChromeEvent] = {}  # request id -> its slice still growing
    out: list[ChromeEvent] = []
    for step in steps:
        end = step["time"] + step["duration"]
        for req in step["requests"]:
            rid = req["id"]
            tid = tids.setdefault(rid, len(tids) + 1)
            current = open_slices.get(rid)
            if current and current["name"] == req["kind"] and current["args"]["last_step"] == step["step"] - 1:
                current["dur"] = _us(end) - current["ts"]
                current["args"]["last_step"] = step["step"]
                current["args"]["tokens"] += req["tokens"]
                continue
            current = {"ph": "X", "name": req["kind"], "ts": _us(step["time"]), "dur": _us(step["duration"]),
                       "pid": pid, "tid": tid,
                       "args": {"first_step": step["step"], "last_step": step["step"], "tokens": req["tokens"]}}
            open_slices[rid] = current
            out.append(current)
    return _metadata(pid, f"requests (run {run_index})", {t: f"request {r}" for r, t in tids.items()}) + out


def write_chrome_trace(events: list[TraceEvent], out: str | Path) -> None:
    Path(out).write_text(json.dumps(to_chrome_trace(events)))
