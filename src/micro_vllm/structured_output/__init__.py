"""Structured output (JSON schemas, regexes, choices, grammars) with xgrammar, as vLLM does it.

Only the params are imported here: they are pure Python, and ``SamplingParams`` holds them. The
manager (``micro_vllm.structured_output.manager``) imports xgrammar and torch, and is loaded only when
a request asks for structured output.
"""

from micro_vllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
