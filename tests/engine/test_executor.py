"""The Engine reaches the device only through the Executor interface, and uses all of it: an executor
that implements ``Executor`` (a multi-process one, say) can replace ``SingleProcessExecutor``."""

from __future__ import annotations

import pytest

from micro_vllm import LLM, SamplingParams
from micro_vllm.engine import engine as engine_module
from micro_vllm.executor.abstract import Executor
from micro_vllm.executor.single_process import SingleProcessExecutor
from helpers.tiny_models import make_tiny_model


class RecordingExecutor:
    """Passes every call on to a real SingleProcessExecutor and records the name of what was used."""

    def __init__(self, *args) -> None:
        self.inner = SingleProcessExecutor(*args)
        self.used: set[str] = set()

    def __getattr__(self, name: str):
        self.used.add(name)
        return getattr(self.inner, name)


def test_single_process_executor_is_an_executor() -> None:
    assert issubclass(SingleProcessExecutor, Executor)
    assert not getattr(SingleProcessExecutor, "__abstractmethods__", None)


def test_engine_uses_exactly_the_executor_interface(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "SingleProcessExecutor", RecordingExecutor)
    llm = LLM(model=str(make_tiny_model("llama", tmp_path)), device="cpu", dtype="float32",
              max_model_len=64, block_size=8)
    engine = llm.engine
    executor = engine.executor
    [output] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    # A step whose results are dropped: what a failed step leaves, and what reset_batch is for.
    engine.add_request("dropped", [5, 6, 7], SamplingParams(max_tokens=4))
    engine.step()
    engine.abort_all_requests()
    llm.shutdown()
    assert executor.used == Executor.__abstractmethods__
