"""Structured output (JSON schemas, regexes, choices, grammars) with xgrammar, as vLLM does it."""

from micro_vllm.structured_output.manager import (
    StructuredOutputGrammar,
    StructuredOutputManager,
    apply_grammar_bitmask,
)
from micro_vllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputGrammar", "StructuredOutputManager", "StructuredOutputsParams", "apply_grammar_bitmask"]
