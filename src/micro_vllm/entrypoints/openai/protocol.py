"""OpenAI's request and response bodies (with vLLM's extra request and response fields), OpenAI's error
object, and the one mapping from a request to ``SamplingParams``.

Pydantic checks the shape of a body (types, required fields); the values are checked once, by
``to_sampling_params`` where the rule is the server's (vLLM's rules and messages: ``max_tokens`` against
the room the prompt leaves, ``stream_options`` only with ``stream``, ``top_logprobs`` only with
``logprobs``, ``prompt_logprobs`` not with ``stream``) and by ``SamplingParams`` otherwise, whose errors
name the field and the value.
"""

from __future__ import annotations

import math
import time
from http import HTTPStatus
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from micro_vllm.sampling.params import RequestOutputKind, SamplingParams
from micro_vllm.structured_output import StructuredOutputsParams
from micro_vllm.validation import short_repr


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


class OpenAIError(Exception):
    """A refusal with its HTTP status and the request field at fault, sent as OpenAI's error object."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    def response(self) -> ErrorResponse:
        return error_response(str(self), self.status, self.param)


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    """OpenAI's error object; ``type`` names the status as vLLM and OpenAI's client do: BadRequestError,
    NotFoundError, InternalServerError..."""
    name = status.phrase.replace(" ", "")
    if status == HTTPStatus.UNAUTHORIZED:
        kind = "AuthenticationError"
    else:
        kind = name if name.endswith("Error") else name + "Error"  # not InternalServerErrorError
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status.value))


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk


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
    stop_token_ids: list[StrictInt] | None = None  # strict: JSON's true is no token id
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar or json_object
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, in the response
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids, in the response
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_continuous_usage(self) -> bool:
        """vLLM's rule: the usage in every chunk only when the usage is asked for at all."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: int | None = 16  # OpenAI's default; null: what max_model_len leaves, as in vLLM
    logprobs: int | None = None  # how many top logprobs per token, beside the sampled one's
    echo: bool = False  # the prompt before the completion (in its text, token ids and logprobs)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: the prompt alone, as lm-evaluation-harness asks for scores."""
        return self.echo and self.max_tokens == 0


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed piece of the tool call at ``index``: its first carries the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    # An assistant message's tool calls, and a tool message's answer to one: for the chat template.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults); checked in entrypoints.openai.tool_choice.
    tool_choice: Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoiceParam, None] = None
    parallel_tool_calls: bool | None = None  # taken and ignored, as vLLM does


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                       max_model_len: int) -> SamplingParams:
    """The request's SamplingParams, streaming DELTA outputs, for a prompt of ``num_prompt_tokens``.
    vLLM's rules: the prompt must leave room for a token; a ``max_tokens`` the room cannot hold is
    refused, and none means all the room. OpenAI's ``null`` means the engine's default."""
    chat = isinstance(request, ChatCompletionRequest)
    if num_prompt_tokens >= max_model_len:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                          f"has {num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                          param="messages" if chat else "prompt")
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("Stream options can only be defined when `stream=True`.", param="stream_options")
    if request.stream and request.prompt_logprobs is not None and request.prompt_logprobs != 0:
        raise OpenAIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    structured_outputs = _structured_outputs(request)
    return SamplingParams(
        n=request.n,
        max_tokens=_max_tokens(request, num_prompt_tokens, max_model_len),
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
        logprobs=_chat_logprobs(request) if chat else request.logprobs,
        prompt_logprobs=_prompt_logprobs(request),
        stop=request.stop,
        stop_token_ids=request.stop_token_ids or (),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        structured_outputs=structured_outputs,
        output_kind=RequestOutputKind.DELTA,
    )


def request_field(request: CompletionRequest | ChatCompletionRequest, name: str) -> str:
    """The request's field for a SamplingParams or engine field that an error names."""
    if name == "prompt_token_ids":
        return "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if isinstance(request, ChatCompletionRequest):
        if name == "logprobs":
            return "top_logprobs"
        if name == "max_tokens" and request.max_completion_tokens is not None:
            return "max_completion_tokens"
    return name


def _max_tokens(request: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                max_model_len: int) -> int:
    """The asked-for ``max_tokens`` (chat: ``max_completion_tokens`` if given), checked against the room
    the prompt leaves; all of that room when none is asked for."""
    name = request_field(request, "max_tokens")
    value = getattr(request, name)
    room = max_model_len - num_prompt_tokens
    if value is None:
        return room
    if not isinstance(request, ChatCompletionRequest) and request.echo_only:
        return 1  # the engine samples at least one token; the response leaves it out
    if value < 1:
        raise OpenAIError(f"{name} must be at least 1, got {value}.", param=name)
    if value > room:
        raise OpenAIError(f"'max_tokens' or 'max_completion_tokens' is too large: {value}. This model's maximum "
                          f"context length is {max_model_len} tokens and your request has {num_prompt_tokens} "
                          f"input tokens ({value} > {max_model_len} - {num_prompt_tokens}).", param=name)
    return value


def _prompt_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """``prompt_logprobs``; for a completion with ``echo`` and none asked, ``logprobs`` (vLLM's rule:
    the echoed prompt's tokens get the logprobs its completion's do)."""
    if request.prompt_logprobs is None and isinstance(request, CompletionRequest) and request.echo:
        return request.logprobs
    return request.prompt_logprobs


def _chat_logprobs(request: ChatCompletionRequest) -> int | None:
    """``top_logprobs`` beside each sampled token's logprob when ``logprobs`` is true; vLLM's checks."""
    top = request.top_logprobs
    if top is not None and top < 0 and top != -1:
        raise OpenAIError("`top_logprobs` must be a positive value or -1.", param="top_logprobs")
    if top and not request.logprobs:
        raise OpenAIError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    return (top or 0) if request.logprobs else None


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
            raise OpenAIError("structured_outputs and response_format are not allowed together; give one",
                              param="structured_outputs")
        try:
            return StructuredOutputsParams(**request.structured_outputs)
        except TypeError:
            raise OpenAIError(f"structured_outputs={short_repr(request.structured_outputs)} is not allowed; give one "
                              "of json, regex, choice, grammar or json_object", param="structured_outputs") from None
        except ValueError as error:
            if str(error).startswith("structured_outputs."):
                raise  # it names the field: structured_outputs.regex=...
            raise OpenAIError(str(error), param="structured_outputs") from None  # two constraints, or none
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.json_schema is None:
        raise OpenAIError("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                          param="response_format")
    try:
        return StructuredOutputsParams(json=response_format.json_schema.json_schema)
    except ValueError as error:  # named as the params name it; the client wrote it here
        message = str(error).replace("structured_outputs.json", "response_format.json_schema.schema", 1)
        raise OpenAIError(message, param="response_format.json_schema.schema") from None


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


class PromptLogprob(OpenAIBaseModel):
    """One token's entry in vLLM's ``prompt_logprobs``: its logprob, rank in the vocabulary and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: per prompt token, its own and the top tokens' entries by token id; the
# first token's is null (nothing predicts it).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the choice's (in a stream, the chunk's)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (in a stream, the first chunk's)


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
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, in each choice's first chunk


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
    """vLLM's two forms: a ``prompt``, or chat ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: the tokenizer's own token strings


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
