"""The OpenAI endpoints' work: from a validated request body to the engine and back.

Everything that can refuse a request (the model name, the prompt and its length, the sampling
fields, the engine's own checks) does so before the response starts, as an ``OpenAIError`` with its
HTTP status; a streamed response starts only once the engine has accepted the request and given its
first output. Streams are server-sent events, ``data: {chunk}`` lines ending with ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus

from micro_vllm.engine.async_llm import AsyncLLM, EngineDeadError
from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
from micro_vllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobContent,
    ChatMessage,
    ChatMessageParam,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    to_sampling_params,
)


class OpenAIError(Exception):
    """A refusal with its HTTP status, sent as OpenAI's error object."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    def response(self) -> ErrorResponse:
        return error_response(str(self), self.status, self.param)


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    """OpenAI's error object; ``type`` is the status' name as vLLM writes it (BadRequestError...)."""
    kind = {HTTPStatus.UNAUTHORIZED: "AuthenticationError"}.get(status, status.phrase.replace(" ", "") + "Error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status.value))


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], model_path: str) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.model_path = model_path

    # -- the endpoints -------------------------------------------------------------------------

    def show_available_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.model_path, max_model_len=self.engine.max_model_len)
                               for name in self.served_model_names])

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self._check_model(request.model)
        text, token_ids = self._completion_prompt(request.prompt)
        return await self._serve(request, text, token_ids, "cmpl")

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        self._check_model(request.model)
        text = self._render_chat(request.messages, request.add_generation_prompt)
        # The template already holds any special tokens: encoding must not add them again.
        return await self._serve(request, text, self.tokenizer.encode(text, add_special_tokens=False), "chatcmpl")

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give either 'prompt' or 'messages'", param="prompt")
        if request.messages is not None:
            tokens = self.tokenizer.encode(self._render_chat(request.messages, request.add_generation_prompt),
                                           add_special_tokens=False)
        else:
            tokens = self._tokenizer().encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise OpenAIError(f"tokens contain {bad[:5]} outside the vocabulary; allowed ids are "
                              f"0..{self.engine.vocab_size - 1}", param="tokens")
        return DetokenizeResponse(prompt=self._tokenizer().decode(request.tokens))

    # -- requests in ---------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist; this server serves {self.served_model_names}",
                              HTTPStatus.NOT_FOUND, param="model")

    def _model_name(self, model: str | None) -> str:
        return model or self.served_model_names[0]

    def _tokenizer(self):
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer: give prompts as token ids")
        return self.tokenizer

    def _completion_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(f"prompt holds {len(prompt)} prompts; this server takes one per request",
                                  param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, self._tokenizer().encode(prompt, add_special_tokens=True)
        return None, prompt

    def _render_chat(self, messages: list[ChatMessageParam], add_generation_prompt: bool) -> str:
        tokenizer = self._tokenizer()
        if not tokenizer.chat_template:
            raise OpenAIError("this model has no chat template; use /v1/completions", param="messages")
        conversation = [{"role": m.role, "content": _message_text(m.content)} for m in messages]
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)

    async def _serve(self, request, text: str | None, token_ids: list[int], id_prefix: str):
        """Run a completion or chat request: its stream of events, or its whole response."""
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        outputs = await self._generate(request, text, token_ids, request_id)
        model = self._model_name(request.model)
        chat = isinstance(request, ChatCompletionRequest)
        if request.stream:
            return self._stream(request, outputs, request_id, model, len(token_ids))
        choices = await _gather(outputs)
        usage = _usage(len(token_ids), sum(len(c.token_ids) for c in choices))
        if chat:
            return ChatCompletionResponse(id=request_id, model=model, usage=usage, choices=[
                ChatCompletionResponseChoice(
                    index=c.index, message=ChatMessage(role="assistant", content=c.text), finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, logprobs=self._chat_logprobs(request, c.token_ids, c.logprobs),
                ) for c in choices])
        return CompletionResponse(id=request_id, model=model, usage=usage, choices=[
            CompletionResponseChoice(
                index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=self._completion_logprobs(request, c.token_ids, c.logprobs),
            ) for c in choices])

    async def _generate(self, request, text: str | None, token_ids: list[int],
                        request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Start the request; return its outputs once the engine has accepted it and given the first.
        An EngineDeadError passes through (the app answers it with a 500)."""
        room = self.engine.max_model_len - len(token_ids)
        if room < 1:
            raise OpenAIError(f"This model's maximum context length is {self.engine.max_model_len} tokens, but the "
                              f"prompt has {len(token_ids)}: shorten it so that at least one token can be generated",
                              param="messages" if isinstance(request, ChatCompletionRequest) else "prompt")
        try:
            params = to_sampling_params(request, room)
            outputs = self.engine.generate({"prompt": text, "prompt_token_ids": token_ids}, params, request_id)
            first = await anext(outputs)
        except (ValueError, TypeError) as error:
            raise OpenAIError(str(error), param=_named_field(str(error))) from None
        return _prepend(first, outputs)

    # -- responses out -------------------------------------------------------------------------

    async def _stream(self, request, outputs, request_id: str, model: str,
                      num_prompt_tokens: int) -> AsyncIterator[str]:
        """Server-sent events: a chunk for each choice's new text (in chat, a first chunk naming the
        role), the usage if asked, then [DONE]. An engine that dies mid-stream ends it with an error event
        (the status was sent already)."""
        chat = isinstance(request, ChatCompletionRequest)
        response_cls = ChatCompletionStreamResponse if chat else CompletionResponse
        num_tokens: dict[int, int] = {}  # each choice's tokens so far, by index
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    for completion in output.outputs:
                        if chat and completion.index not in num_tokens:
                            role = ChatCompletionStreamChoice(index=completion.index,
                                                              delta=DeltaMessage(role="assistant", content=""))
                            yield _sse(response_cls(id=request_id, model=model, choices=[role]))
                        num_tokens[completion.index] = num_tokens.get(completion.index, 0) + len(completion.token_ids)
                        if completion.text or completion.finish_reason:
                            choice = self._stream_choice(request, completion)
                            yield _sse(response_cls(id=request_id, model=model, choices=[choice]))
        except EngineDeadError as error:
            yield _sse(error_response(str(error), HTTPStatus.INTERNAL_SERVER_ERROR))
        else:
            if request.include_usage:
                usage = _usage(num_prompt_tokens, sum(num_tokens.values()))
                yield _sse(response_cls(id=request_id, model=model, choices=[], usage=usage))
        yield "data: [DONE]\n\n"

    def _stream_choice(self, request, completion: CompletionOutput):
        if isinstance(request, ChatCompletionRequest):
            return ChatCompletionStreamChoice(
                index=completion.index, delta=DeltaMessage(content=completion.text),
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                logprobs=self._chat_logprobs(request, completion.token_ids, completion.logprobs),
            )
        return CompletionResponseChoice(
            index=completion.index, text=completion.text, finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            logprobs=self._completion_logprobs(request, completion.token_ids, completion.logprobs),
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _completion_logprobs(self, request: CompletionRequest, token_ids: list[int],
                             logprobs: list[dict] | None) -> CompletionLogprobs | None:
        """OpenAI's legacy shape from the engine's logprobs (vLLM's: per position, token id -> Logprob
        with ``logprob`` and ``rank``: the sampled token's, and the ``request.logprobs`` best)."""
        if not logprobs:
            return None
        result = CompletionLogprobs()
        offset = 0
        for token_id, position in zip(token_ids, logprobs):
            token = self._token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(position[token_id].logprob)
            result.top_logprobs.append({self._token_text(t): lp.logprob for t, lp in position.items()
                                        if lp.rank <= request.logprobs})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _chat_logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                       logprobs: list[dict] | None) -> ChatChoiceLogprobs | None:
        """OpenAI's chat shape: each position's sampled token, and the ``request.top_logprobs`` best."""
        if not logprobs:
            return None
        top_n = request.top_logprobs or 0
        def entry(token_id: int, logprob: float) -> ChatLogprob:
            token = self._token_text(token_id)
            return ChatLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        content = []
        for token_id, position in zip(token_ids, logprobs):
            sampled = entry(token_id, position[token_id].logprob)
            top = [entry(t, lp.logprob) for t, lp in position.items() if lp.rank <= top_n]
            content.append(ChatLogprobContent(**sampled.model_dump(), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)


def _named_field(message: str) -> str | None:
    """The field an engine error names first ("top_p=2.0 is not allowed; ..." names top_p)."""
    match = re.match(r"(\w+)=", message)
    return match.group(1) if match else None


def _message_text(content) -> str:
    """A message's text: a string, or OpenAI's list of content parts, of which only text is taken."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(f"message content part {part!r} is not allowed; only {{'type': 'text', 'text': str}}",
                              param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


async def _prepend(first: RequestOutput, rest: AsyncGenerator[RequestOutput, None]):
    """The outputs again, the first one included; closing this closes (and so aborts) the request."""
    async with contextlib.aclosing(rest):
        yield first
        if not first.finished:
            async for output in rest:
                yield output


async def _gather(outputs) -> list[CompletionOutput]:
    """The request's sequences, whole, by index: its DELTA outputs folded into one."""
    whole = None
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            if whole is None:
                whole = output
            else:
                whole.add(output)
    return sorted(whole.outputs, key=lambda completion: completion.index)


def _sse(response) -> str:
    return f"data: {response.model_dump_json()}\n\n"


def _usage(num_prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=num_prompt_tokens + completion_tokens)
