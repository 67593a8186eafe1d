"""The OpenAI endpoints' work: from a request's body to the engine and back.

Everything that can refuse a request (the body, the model name, the prompt and its length, the
sampling fields, the engine's own checks) does so before the response starts, as an ``OpenAIError``
with its HTTP status and the field at fault; a streamed response starts only once the engine has
accepted the request and given its first output. Streams are server-sent events, ``data: {chunk}``
lines ending with ``data: [DONE]``.

What a request costs before the engine sees it (parsing its body, rendering the chat template,
tokenizing, building its params and constraint) and a whole response's JSON run on a small thread pool,
off the event loop, as vLLM tokenizes asynchronously: a 10 MB prompt keeps the tokenizer busy for tens
of seconds on a CPU, and on the event loop every other stream and ``/health`` would wait for it. A
thread helps only while the tokenizer lets go of the GIL: a fast tokenizer's batch encode and decode
do, its one-text ``encode`` and ``decode`` (and transformers' around them) hold it throughout, so the
server calls the batch ones with a batch of one (docs/serving.md has the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

import xgrammar  # noqa: F401 - loaded with the server: a constraint's check would load it on a request's thread
from pydantic import BaseModel, ValidationError

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
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    error_response,
    request_field,
    to_sampling_params,
)
from micro_vllm.entrypoints.openai.tool_calling import (
    prepare_tool_request,
    template_tool_calls,
    template_tools,
    tool_finish_reason,
    tool_parser_for,
)
from micro_vllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from micro_vllm.sampling.params import SamplingParams
from micro_vllm.validation import short_repr

logger = logging.getLogger(__name__)

# Threads for the work before and after the engine. The tokenizer releases the GIL, so they run in
# parallel; a few, so that one huge prompt does not hold up everyone else's.
PREPROCESS_THREADS = 4

# JSON has no -inf or NaN; a logprob the model gives as -inf (a token it rules out) is sent as vLLM
# sends it, this floor.
LOGPROB_FLOOR = -9999.0

# At most this many of pydantic's complaints about a body go into the message.
_MAX_PROBLEMS = 5

_T = TypeVar("_T")


@dataclass(frozen=True)
class PreparedRequest:
    """A generation request ready for the engine: its body, prompt (None when given as ids) and params."""

    request: CompletionRequest | ChatCompletionRequest
    text: str | None
    token_ids: list[int]
    params: SamplingParams


class OpenAIServing:
    """The endpoints on one ``AsyncLLM``. ``enable_log_requests`` logs each request the engine gets,
    its prompt (text or ids) cut to ``max_log_len`` characters or ids (vLLM's flags; None: whole).
    ``tool_parser`` names the parser that finds tool calls for ``tool_choice="auto"`` (vLLM's
    ``--enable-auto-tool-choice --tool-call-parser NAME``); None refuses "auto"."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], model_path: str,
                 enable_log_requests: bool = False, max_log_len: int | None = None,
                 tool_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.enable_log_requests = enable_log_requests
        self.max_log_len = max_log_len
        self.tool_parser: type[ToolParser] | None = (ToolParserManager.get_tool_parser(tool_parser) if tool_parser
                                                     else None)
        self._executor = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="micro-vllm-preprocess")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the endpoints -------------------------------------------------------------------------

    def show_available_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.model_path, max_model_len=self.engine.max_model_len)
                               for name in self.served_model_names])

    async def create_completion(self, body: bytes) -> str | AsyncIterator[str]:
        """The response's JSON, or its stream of events."""
        return await self._serve(await self._in_thread(self._prepare_completion, body), "cmpl")

    async def create_chat_completion(self, body: bytes) -> str | AsyncIterator[str]:
        return await self._serve(await self._in_thread(self._prepare_chat, body), "chatcmpl")

    async def tokenize(self, body: bytes) -> str:
        return await self._in_thread(self._tokenize, body)

    async def detokenize(self, body: bytes) -> str:
        return await self._in_thread(self._detokenize, body)

    # -- requests in (on the thread pool) ------------------------------------------------------

    async def _in_thread(self, work: Callable[..., _T], *args) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def _prepare_completion(self, body: bytes) -> PreparedRequest:
        request = _parse(CompletionRequest, body)
        self._check_model(request.model)
        text, token_ids = self._completion_prompt(request.prompt)
        return PreparedRequest(request, text, token_ids, self._sampling_params(request, token_ids))

    def _prepare_chat(self, body: bytes) -> PreparedRequest:
        request = _parse(ChatCompletionRequest, body)
        self._check_model(request.model)
        request = prepare_tool_request(request, self.tool_parser)
        text = self._render_chat(request.messages, request.add_generation_prompt, template_tools(request))
        # The template already holds any special tokens: encoding must not add them again.
        token_ids = self._encode(text, add_special_tokens=False)
        return PreparedRequest(request, text, token_ids, self._sampling_params(request, token_ids))

    def _tokenize(self, body: bytes) -> str:
        request = _parse(TokenizeRequest, body)
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give either 'prompt' or 'messages'", param="prompt")
        if request.messages is not None:
            tokens = self._encode(self._render_chat(request.messages, request.add_generation_prompt),
                                  add_special_tokens=False)
        else:
            tokens = self._encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len,
                                tokens=tokens).model_dump_json()

    def _detokenize(self, body: bytes) -> str:
        request = _parse(DetokenizeRequest, body)
        self._check_model(request.model)
        self._check_vocabulary("tokens", request.tokens)
        return DetokenizeResponse(prompt=self._decode(request.tokens)).model_dump_json()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{short_repr(model)}` does not exist; this server serves "
                              f"{self.served_model_names}", HTTPStatus.NOT_FOUND, param="model")

    def _check_vocabulary(self, name: str, token_ids: Iterable[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise OpenAIError(f"{name} contain {bad[:5]} outside the vocabulary; allowed ids are "
                              f"0..{self.engine.vocab_size - 1}", param=name)

    def _model_name(self, model: str | None) -> str:
        return model or self.served_model_names[0]

    def _tokenizer(self):
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer: give prompts as token ids")
        return self.tokenizer

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The text's token ids; from a fast tokenizer's batch encode, which releases the GIL (module
        docstring)."""
        tokenizer = self._tokenizer()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        [encoding] = backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def _decode(self, token_ids: list[int]) -> str:
        """The tokens' text, as ``tokenizer.decode`` gives it; from a fast tokenizer's batch decode,
        which releases the GIL, unless transformers would clean up spaces after it."""
        tokenizer = self._tokenizer()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or tokenizer.clean_up_tokenization_spaces:
            return tokenizer.decode(token_ids)
        [text] = backend.decode_batch([token_ids], skip_special_tokens=False)
        return text

    def _completion_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(f"prompt holds {len(prompt)} prompts; this server takes one per request",
                                  param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise OpenAIError("prompt is empty; give at least one character or token id", param="prompt")
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, add_special_tokens=True)
        return None, prompt

    def _render_chat(self, messages: list[ChatMessageParam], add_generation_prompt: bool,
                     tools: list[dict] | None = None) -> str:
        tokenizer = self._tokenizer()
        if not tokenizer.chat_template:
            raise OpenAIError("this model has no chat template; use /v1/completions", param="messages")
        conversation = [_template_message(m) for m in messages]
        try:
            return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as error:
            # The model's template refuses the conversation (jinja's raise_exception, say): as vLLM does,
            # a jinja TemplateError is the client's, found by name so as not to import jinja.
            if not any(cls.__name__ == "TemplateError" for cls in type(error).__mro__):
                raise
            raise OpenAIError(f"the model's chat template refuses these messages: {error}", param="messages") from None

    def _sampling_params(self, request, token_ids: list[int]) -> SamplingParams:
        try:
            params = to_sampling_params(request, len(token_ids), self.engine.max_model_len)
        except (ValueError, TypeError) as error:
            raise _refusal(request, error) from None
        self._check_vocabulary("stop_token_ids", params.stop_token_ids)
        return params

    # -- the engine ----------------------------------------------------------------------------

    async def _serve(self, prepared: PreparedRequest, id_prefix: str) -> str | AsyncIterator[str]:
        """Run a completion or chat request: its stream of events, or its whole response's JSON."""
        request, num_prompt_tokens = prepared.request, len(prepared.token_ids)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        if self.enable_log_requests:
            self._log_request(request_id, prepared)
        outputs = await self._generate(prepared, request_id)
        model = self._model_name(request.model)
        if request.stream:
            return self._stream(request, outputs, request_id, model, num_prompt_tokens)
        choices = await _gather(outputs)
        return await self._in_thread(self._response_json, request, request_id, model, num_prompt_tokens, choices)

    async def _generate(self, prepared: PreparedRequest, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Start the request; return its outputs once the engine has accepted it and given the first.
        An EngineDeadError passes through (the app answers it with a 500)."""
        prompt = {"prompt": prepared.text, "prompt_token_ids": prepared.token_ids}
        try:
            outputs = self.engine.generate(prompt, prepared.params, request_id)
            first = await anext(outputs)
        except (ValueError, TypeError) as error:
            raise _refusal(prepared.request, error) from None
        return _prepend(first, outputs)

    def _log_request(self, request_id: str, prepared: PreparedRequest) -> None:
        cut = slice(self.max_log_len)
        text = prepared.text[cut] if prepared.text is not None else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, text,
                    prepared.params, prepared.token_ids[cut])

    # -- responses out -------------------------------------------------------------------------

    def _response_json(self, request, request_id: str, model: str, num_prompt_tokens: int,
                       choices: list[CompletionOutput]) -> str:
        usage = _usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices))
        if isinstance(request, ChatCompletionRequest):
            response = ChatCompletionResponse(id=request_id, model=model, usage=usage, choices=[
                ChatCompletionResponseChoice(
                    index=c.index, **self._chat_message(request, c), stop_reason=c.stop_reason,
                    logprobs=self._chat_logprobs(request, c.token_ids, c.logprobs),
                ) for c in choices])
        else:
            response = CompletionResponse(id=request_id, model=model, usage=usage, choices=[
                CompletionResponseChoice(
                    index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=self._completion_logprobs(request, c.token_ids, c.logprobs),
                ) for c in choices])
        return response.model_dump_json()

    async def _stream(self, request, outputs, request_id: str, model: str,
                      num_prompt_tokens: int) -> AsyncIterator[str]:
        """Server-sent events: a chunk for each choice's new text (in chat, a first chunk naming the
        role), the usage if asked, then [DONE]. An engine that dies mid-stream ends it with an error event
        (the status was sent already)."""
        chat = isinstance(request, ChatCompletionRequest)
        response_cls = ChatCompletionStreamResponse if chat else CompletionResponse
        num_tokens: dict[int, int] = {}  # each choice's tokens so far, by index
        chat_deltas: dict[int, _ChatDeltas] = {}
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    for completion in output.outputs:
                        if chat and completion.index not in num_tokens:
                            chat_deltas[completion.index] = _ChatDeltas(tool_parser_for(request, self.tool_parser))
                            role = ChatCompletionStreamChoice(index=completion.index,
                                                              delta=DeltaMessage(role="assistant", content=""))
                            yield _sse(response_cls(id=request_id, model=model, choices=[role]))
                        num_tokens[completion.index] = num_tokens.get(completion.index, 0) + len(completion.token_ids)
                        if completion.text or completion.finish_reason:
                            choice = self._stream_choice(request, completion, chat_deltas.get(completion.index))
                            if choice is not None:
                                yield _sse(response_cls(id=request_id, model=model, choices=[choice]))
        except EngineDeadError as error:
            yield _sse(error_response(str(error), HTTPStatus.INTERNAL_SERVER_ERROR))
        else:
            if request.include_usage:
                usage = _usage(num_prompt_tokens, sum(num_tokens.values()))
                yield _sse(response_cls(id=request_id, model=model, choices=[], usage=usage))
        yield "data: [DONE]\n\n"

    def _stream_choice(self, request, completion: CompletionOutput, chat_deltas: _ChatDeltas | None = None):
        """The chunk of a choice's new output (a chat choice's through its ``chat_deltas``; None: its
        text as it is), or None where a tool parser holds all of it back."""
        if isinstance(request, ChatCompletionRequest):
            delta, finish_reason = (chat_deltas or _ChatDeltas(None)).delta(completion)
            logprobs = self._chat_logprobs(request, completion.token_ids, completion.logprobs)
            if delta is None and finish_reason is None and logprobs is None:
                return None
            return ChatCompletionStreamChoice(
                index=completion.index, delta=delta or DeltaMessage(), finish_reason=finish_reason,
                stop_reason=completion.stop_reason, logprobs=logprobs,
            )
        return CompletionResponseChoice(
            index=completion.index, text=completion.text, finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            logprobs=self._completion_logprobs(request, completion.token_ids, completion.logprobs),
        )

    def _chat_message(self, request: ChatCompletionRequest, completion: CompletionOutput) -> dict:
        """A whole chat choice's ``message`` and ``finish_reason``: its text, or the tool calls in it."""
        parser = tool_parser_for(request, self.tool_parser)
        if parser is None:
            return {"message": ChatMessage(role="assistant", content=completion.text),
                    "finish_reason": completion.finish_reason}
        extracted = parser.extract_tool_calls(completion.text)
        return {"message": ChatMessage(role="assistant", content=extracted.content, tool_calls=extracted.tool_calls),
                "finish_reason": tool_finish_reason(completion.finish_reason, extracted.tools_called)}

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
            result.token_logprobs.append(_json_logprob(position[token_id].logprob))
            result.top_logprobs.append({self._token_text(t): _json_logprob(lp.logprob) for t, lp in position.items()
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
            return ChatLogprob(token=token, logprob=_json_logprob(logprob), bytes=list(token.encode()))

        content = []
        for token_id, position in zip(token_ids, logprobs):
            sampled = entry(token_id, position[token_id].logprob)
            top = [entry(t, lp.logprob) for t, lp in position.items() if lp.rank <= top_n]
            content.append(ChatLogprobContent(**sampled.model_dump(), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)


class _ChatDeltas:
    """One streamed chat choice's deltas: its new text, or what its tool parser reads in it."""

    def __init__(self, tool_parser: ToolParser | None) -> None:
        self.tool_parser = tool_parser
        self.text = ""

    def delta(self, completion: CompletionOutput) -> tuple[DeltaMessage | None, str | None]:
        """The delta for the choice's new output, and its finish reason."""
        if self.tool_parser is None:
            return DeltaMessage(content=completion.text), completion.finish_reason
        self.text += completion.text
        finished = completion.finish_reason is not None
        delta = self.tool_parser.extract_tool_calls_streaming(self.text, finished)
        return delta, tool_finish_reason(completion.finish_reason, self.tool_parser.tools_streamed)


def _parse(model: type[BaseModel], body: bytes):
    """The body as ``model``, or a 400 naming the field at fault. Pydantic's own JSON parser refuses
    what is not UTF-8, not JSON, a string with a lone surrogate (no text can hold it) and nesting past
    200 levels, before any of it becomes Python objects."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        problems = error.errors(include_url=False)
        message = "; ".join(f"{'.'.join(map(str, p['loc'])) or 'body'}: {p['msg']}" for p in problems[:_MAX_PROBLEMS])
        if len(problems) > _MAX_PROBLEMS:
            message += f"; and {len(problems) - _MAX_PROBLEMS} more"
        param = str(problems[0]["loc"][0]) if problems and problems[0]["loc"] else None
        raise OpenAIError(message, param=param) from None


def _refusal(request, error: Exception) -> OpenAIError:
    """A ValueError or TypeError of SamplingParams or the engine as a 400 naming the request's field:
    their messages start with the field they refuse ("top_p=2.0 is not allowed; ...", "logit_bias
    contain [...] outside the vocabulary"), in their names, which a chat request may spell otherwise."""
    message = str(error)
    match = re.match(r"([a-z_][\w.]*)(=| contain )", message)
    if match is None:
        return OpenAIError(message)
    name = match.group(1)
    field = request_field(request, name)
    return OpenAIError(field + message[len(name):], param=field)


def _json_logprob(logprob: float) -> float:
    """A logprob JSON can carry: -inf and NaN (and anything below the floor) become ``LOGPROB_FLOOR``."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the comparison too


def _template_message(message: ChatMessageParam) -> dict:
    """A message as the chat template takes it: its text, and any tool calls or tool call it answers."""
    entry = {"role": message.role, "content": _message_text(message.content)}
    if message.tool_calls:
        entry["tool_calls"] = template_tool_calls(message)
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        entry["name"] = message.name
    return entry


def _message_text(content) -> str:
    """A message's text: a string, or OpenAI's list of content parts, of which only text is taken."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(f"message content part {short_repr(part)} is not allowed; only "
                              "{'type': 'text', 'text': str}", param="messages")
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
