"""OpenAI's request and response bodies (with vLLM's extra request fields), and the one mapping from
a request to ``SamplingParams``.

Pydantic checks the shape of a body (types, required fields); the values' ranges are checked once,
by ``SamplingParams``, whose errors name the field and the value.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from micro_vllm.sampling.params import RequestOutputKind, SamplingParams
from micro_vllm.structured_output import StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do: clients send fields a server may not know.
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar or json_object
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None  # how many top logprobs per token, beside the sampled one's


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest, room: int) -> SamplingParams:
    """The request's SamplingParams, streaming DELTA outputs. ``room`` is what ``max_model_len``
    leaves after the prompt: the default ``max_tokens`` of chat, and a cap on any asked for (vLLM's
    rule). OpenAI's ``null`` means the engine's default; SamplingParams checks every value."""
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens or request.max_tokens or room
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        max_tokens = 16 if request.max_tokens is None else request.max_tokens  # OpenAI's default
        logprobs = request.logprobs
    return SamplingParams(
        n=request.n,
        max_tokens=min(max_tokens, room),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=_logit_bias(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        min_tokens=request.min_tokens or 0,
        logprobs=logprobs,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids or (),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        structured_outputs=_structured_outputs(request),
        output_kind=RequestOutputKind.DELTA,
    )


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON keys are strings; the engine takes token ids. Biases past OpenAI's [-100, 100] are clamped
    to it, as OpenAI's and vLLM's servers do (the engine itself refuses them)."""
    if not logit_bias:
        return None
    try:
        return {int(token_id): _clamp(bias, -100.0, 100.0) for token_id, bias in logit_bias.items()}
    except ValueError:
        raise ValueError(f"logit_bias={logit_bias!r} is not allowed; its keys must be token ids") from None


def _clamp(value: float, low: float, high: float) -> float:
    """``value`` within [low, high]; NaN stays NaN, for the engine's check to refuse."""
    return min(max(value, low), high) if not math.isnan(value) else value


def _structured_outputs(request: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``, or vLLM's ``structured_outputs`` field (json, regex, choice, grammar)."""
    if request.structured_outputs is not None:
        if request.response_format is not None and request.response_format.type != "text":
            raise ValueError("structured_outputs and response_format are not allowed together; give one")
        try:
            return StructuredOutputsParams(**request.structured_outputs)
        except TypeError:
            raise ValueError(f"structured_outputs={request.structured_outputs!r} is not allowed; give one of json, "
                             "regex, choice, grammar or json_object") from None
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.json_schema is None:
        raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _Response(OpenAIBaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "micro-vllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
