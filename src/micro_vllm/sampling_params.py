"""Where vLLM users import the sampling settings from (``vllm.sampling_params``), so that a script
needs only its package name changed."""

from micro_vllm.sampling.params import RequestOutputKind, SamplingParams
from micro_vllm.structured_output import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
