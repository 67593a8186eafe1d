"""micro-vLLM: a compact, readable LLM inference engine with vLLM V1's architecture.

The public names are loaded on first use, so that ``micro_vllm.core`` can be imported (and tested)
without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "micro_vllm.llm",
    "LLMEngine": "micro_vllm.engine.engine",
    "EngineArgs": "micro_vllm.engine.arg_utils",
    "AsyncEngineArgs": "micro_vllm.engine.arg_utils",
    "LLMConfig": "micro_vllm.config",
    "ModelConfig": "micro_vllm.config",
    "SchedulerConfig": "micro_vllm.config",
    "CacheConfig": "micro_vllm.config",
    "SamplingParams": "micro_vllm.sampling.params",
    "RequestOutputKind": "micro_vllm.sampling.params",
    "StructuredOutputsParams": "micro_vllm.structured_output.params",
    "RequestOutput": "micro_vllm.engine.request_output",
    "CompletionOutput": "micro_vllm.engine.request_output",
    "TraceConfig": "micro_vllm.trace",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from micro_vllm.config import CacheConfig, LLMConfig, ModelConfig, SchedulerConfig
    from micro_vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from micro_vllm.engine.engine import LLMEngine
    from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
    from micro_vllm.llm import LLM
    from micro_vllm.sampling.params import RequestOutputKind, SamplingParams
    from micro_vllm.structured_output.params import StructuredOutputsParams
    from micro_vllm.trace import TraceConfig


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'micro_vllm' has no attribute {name!r}")
