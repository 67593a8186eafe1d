"""Tool-call parsers, by the name ``--tool-call-parser`` takes (vLLM's names): ``hermes`` (Hermes,
Qwen2.5, Qwen3) and ``llama3_json`` (Llama 3.1 and 3.2); and the parsers of a forced ``tool_choice``."""

from micro_vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
)
from micro_vllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from micro_vllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser

__all__ = ["ExtractedToolCallInformation", "Hermes2ProToolParser", "Llama3JsonToolParser", "ToolParser",
           "ToolParserManager"]
