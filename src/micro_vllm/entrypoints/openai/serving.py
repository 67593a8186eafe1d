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
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

import pydantic_core
import xgrammar  # noqa: F401 - loaded with the server: a constraint's check would load it on a request's thread
from pydantic import BaseModel, ValidationError

from micro_vllm.engine.async_llm import AsyncLLM, EngineDeadError
from micro_vllm.engine.request_output import CompletionOutput, RequestOutput
from micro_vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    ChatMessageParam,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    PromptLogprob,
    PromptLogprobs,
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
from micro_vllm.logprobs import Logprob
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

# The most prompts one completion request may list (vLLM's VLLM_MAX_COMPLETION_PROMPTS default): each
# is an engine request, and a body of a few megabytes could otherwise list millions.
MAX_COMPLETION_PROMPTS = 1024

_T = TypeVar("_T")


@dataclass(frozen=True)
class PreparedRequest:
    """A generation request ready for the engine: its body, prompt (None when given as ids, unless
    ``echo`` shows it) and params. A completion with a list of prompts makes one for each."""

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
        return await self._serve([await self._in_thread(self._prepare_chat, body)], "chatcmpl")

    async def tokenize(self, body: bytes) -> str:
        return await self._in_thread(self._tokenize, body)

    async def detokenize(self, body: bytes) -> str:
        return await self._in_thread(self._detokenize, body)

    # -- requests in (on the thread pool) ------------------------------------------------------

    async def _in_thread(self, work: Callable[..., _T], *args) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def _prepare_completion(self, body: bytes) -> list[PreparedRequest]:
        request = _parse(CompletionRequest, body)
        self._check_model(request.model)
        prepared = []
        for text, token_ids in self._completion_prompts(request.prompt):
            if text is None and request.echo:
                self._check_vocabulary("prompt", token_ids)
                text = self._decode(token_ids)  # echo shows the prompt's text, as vLLM does
            prepared.append(PreparedRequest(request, text, token_ids, self._sampling_params(request, token_ids)))
        return prepared

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
        chat = request.messages is not None
        # vLLM's defaults: a chat template holds the special tokens already, a prompt gets them added.
        add_special_tokens = not chat if request.add_special_tokens is None else request.add_special_tokens
        text = self._render_chat(request.messages, request.add_generation_prompt) if chat else request.prompt
        tokens = self._encode(text, add_special_tokens=add_special_tokens)
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens,
                                token_strs=token_strs).model_dump_json()

    def tokenizer_info(self) -> str:
        """vLLM's /tokenizer_info: the tokenizer's settings (tokenizer_config.json's, without the paths
        of its files), its class and chat template."""
        tokenizer = self._tokenizer()
        info = {key: _json_setting(value) for key, value in tokenizer.init_kwargs.items() if not key.endswith("_file")}
        info["tokenizer_class"] = type(tokenizer).__name__
        if tokenizer.chat_template:
            info["chat_template"] = tokenizer.chat_template
        return json.dumps(info, default=str)

    async def create_invocation(self, body: bytes) -> str | AsyncIterator[str]:
        """SageMaker's /invocations (vLLM's): a body with ``messages`` is a chat completion, any other a
        completion (whose refusal names the field a completion lacks)."""
        if await self._in_thread(_has_messages, body):
            return await self.create_chat_completion(body)
        return await self.create_completion(body)

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

    def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """Each prompt of the request (one, or a list of texts or of token id lists): its text (None
        when given as ids) and its ids."""
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(prompts) > MAX_COMPLETION_PROMPTS:
            raise OpenAIError(f"prompt list length {len(prompts)} exceeds the maximum allowed count of "
                              f"{MAX_COMPLETION_PROMPTS}", param="prompt")
        result = []
        for one in prompts:
            if not one:
                raise OpenAIError("prompt is empty; give at least one character or token id", param="prompt")
            result.append((one, self._encode(one, add_special_tokens=True)) if isinstance(one, str) else (None, one))
        return result

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

    async def _serve(self, prepared: list[PreparedRequest], id_prefix: str) -> str | AsyncIterator[str]:
        """Run a completion or chat request, an engine request for each of its prompts: its stream of
        events, or its whole response's JSON."""
        request = prepared[0].request
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # vLLM's ids: each prompt of a list is the response's id and the prompt's position.
        engine_ids = [request_id] if len(prepared) == 1 else [f"{request_id}-{i}" for i in range(len(prepared))]
        if self.enable_log_requests:
            for engine_id, one in zip(engine_ids, prepared):
                self._log_request(engine_id, one)
        outputs = await self._generate(prepared, engine_ids)
        model = self._model_name(request.model)
        if request.stream:
            return self._stream(request, prepared, outputs, request_id, model)
        finals = await asyncio.gather(*map(_gather, outputs))
        return await self._in_thread(self._response_json, request, prepared, request_id, model, finals)

    async def _generate(self, prepared: list[PreparedRequest],
                        engine_ids: list[str]) -> list[AsyncGenerator[RequestOutput, None]]:
        """Start every prompt's request at once; return their outputs once the engine has accepted them
        all and given each one's first. If it refuses one, the others are aborted and the refusal raised;
        an EngineDeadError passes through (the app answers it with a 500)."""
        started = await asyncio.gather(*map(self._start, prepared, engine_ids), return_exceptions=True)
        refusals = [result for result in started if isinstance(result, BaseException)]
        if refusals:
            for result in started:
                if not isinstance(result, BaseException):
                    await result[1].aclose()
            raise refusals[0]
        return [_prepend(first, rest) for first, rest in started]

    async def _start(self, prepared: PreparedRequest,
                     engine_id: str) -> tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]:
        """One prompt's request: its first output, and the rest to come."""
        prompt = {"prompt": prepared.text, "prompt_token_ids": prepared.token_ids}
        try:
            outputs = self.engine.generate(prompt, prepared.params, engine_id)
            return await anext(outputs), outputs
        except (ValueError, TypeError) as error:
            raise _refusal(prepared.request, error) from None

    def _log_request(self, request_id: str, prepared: PreparedRequest) -> None:
        cut = slice(self.max_log_len)
        text = prepared.text[cut] if prepared.text is not None else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, text,
                    prepared.params, prepared.token_ids[cut])

    # -- responses out -------------------------------------------------------------------------

    def _response_json(self, request, prepared: list[PreparedRequest], request_id: str, model: str,
                       finals: list[RequestOutput]) -> str:
        """The whole response: each prompt's choices in turn (index ``prompt_index * n + i``, as vLLM)."""
        num_prompt_tokens = sum(len(one.token_ids) for one in prepared)
        usage = _usage(num_prompt_tokens, sum(_num_completion_tokens(request, c) for f in finals for c in f.outputs))
        if isinstance(request, ChatCompletionRequest):
            [final] = finals
            response = ChatCompletionResponse(
                id=request_id, model=model, usage=usage, prompt_logprobs=_json_prompt_logprobs(final.prompt_logprobs),
                prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None, choices=[
                    ChatCompletionResponseChoice(
                        index=c.index, **self._chat_message(request, c), stop_reason=c.stop_reason,
                        logprobs=self._chat_logprobs(request, c.token_ids, c.logprobs),
                        token_ids=c.token_ids if request.return_token_ids else None,
                    ) for c in final.outputs])
        else:
            response = CompletionResponse(id=request_id, model=model, usage=usage, choices=[
                self._completion_choice(request, one, c, prompt_index * request.n + c.index, final.prompt_logprobs,
                                        first=True)
                for prompt_index, (one, final) in enumerate(zip(prepared, finals)) for c in final.outputs])
        return response.model_dump_json()

    async def _stream(self, request, prepared: list[PreparedRequest], outputs: list[AsyncGenerator],
                      request_id: str, model: str) -> AsyncIterator[str]:
        """Server-sent events: a chunk for each choice's new tokens (in chat, a first chunk naming the
        role; with ``echo``, the prompt first), with ``continuous_usage_stats`` the choice's usage so far,
        then the whole usage if asked, then [DONE]. An engine that dies mid-stream ends it with an error
        event (the status was sent already)."""
        chat = isinstance(request, ChatCompletionRequest)
        created = int(time.time())  # every chunk of a stream has the same (OpenAI's rule)

        def chunk(choices: list[dict], usage: UsageInfo | None) -> str:
            return _sse(_stream_chunk(chat, request_id, created, model, choices, usage))

        continuous_usage = request.include_continuous_usage
        num_tokens: dict[int, int] = {}  # each choice's tokens so far, by index
        text_lengths: dict[int, int] = {}  # each choice's text so far (the logprobs' text_offset), by index
        prompt_logprobs: dict[int, list] = {}  # each prompt's, as the engine gives them with its first tokens
        chat_deltas: dict[int, _ChatDeltas] = {}  # each chat choice's text, or its tool parser, by index
        try:
            async with contextlib.aclosing(_merge(outputs)) as merged:
                async for prompt_index, output in merged:
                    one = prepared[prompt_index]
                    if output.prompt_logprobs:
                        prompt_logprobs.setdefault(prompt_index, output.prompt_logprobs)
                    for completion in output.outputs:
                        index = prompt_index * request.n + completion.index
                        first = index not in num_tokens
                        num_tokens[index] = num_tokens.get(index, 0) + _num_completion_tokens(request, completion)
                        if first and chat:
                            chat_deltas[index] = _ChatDeltas(tool_parser_for(request, self.tool_parser))
                            yield _sse(_chat_role_chunk(request, one, index, request_id, created, model))
                        if not (first or completion.token_ids or completion.finish_reason):
                            continue
                        if chat:
                            choice = self._chat_stream_choice(request, completion, chat_deltas[index])
                            if choice is None:  # a tool parser holds all of it back for now
                                continue
                        else:
                            choice = self._completion_choice(request, one, completion, index,
                                                             prompt_logprobs.get(prompt_index), first,
                                                             text_lengths.get(index, 0))
                            text_lengths[index] = text_lengths.get(index, 0) + len(choice["text"])
                        usage = _usage(len(one.token_ids), num_tokens[index]) if continuous_usage else None
                        yield chunk([choice], usage)
        except EngineDeadError as error:
            yield _sse(error_response(str(error), HTTPStatus.INTERNAL_SERVER_ERROR))
        else:
            if request.include_usage:
                usage = _usage(sum(len(one.token_ids) for one in prepared), sum(num_tokens.values()))
                yield chunk([], usage)
        yield "data: [DONE]\n\n"

    def _chat_stream_choice(self, request: ChatCompletionRequest, completion: CompletionOutput,
                            chat_deltas: _ChatDeltas) -> dict | None:
        """A chat choice's chunk of new output, read through its ``chat_deltas`` (its text as it is, or
        what its tool parser finds); None where the tool parser holds all of it back. The fields of a
        ``ChatCompletionStreamChoice``, in its order (``_stream_chunk`` says why a dict)."""
        delta, finish_reason = chat_deltas.delta(completion)
        logprobs = self._chat_logprobs(request, completion.token_ids, completion.logprobs)
        token_ids = completion.token_ids if request.return_token_ids else None
        if delta is None and finish_reason is None and logprobs is None and not token_ids:
            return None
        return {"index": completion.index, "delta": delta or _delta_message(), "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": completion.stop_reason, "token_ids": token_ids}

    def _chat_message(self, request: ChatCompletionRequest, completion: CompletionOutput) -> dict:
        """A whole chat choice's ``message`` and ``finish_reason``: its text, or the tool calls in it."""
        parser = tool_parser_for(request, self.tool_parser)
        if parser is None:
            return {"message": ChatMessage(role="assistant", content=completion.text),
                    "finish_reason": completion.finish_reason}
        extracted = parser.extract_tool_calls(completion.text)
        return {"message": ChatMessage(role="assistant", content=extracted.content, tool_calls=extracted.tool_calls),
                "finish_reason": tool_finish_reason(completion.finish_reason, extracted.tools_called)}

    def _completion_choice(self, request: CompletionRequest, prepared: PreparedRequest, completion: CompletionOutput,
                           index: int, prompt_logprobs: list | None, first: bool,
                           text_offset: int = 0) -> dict:
        """A completion's choice, or a stream's chunk of it (``first``: its first chunk, where ``echo``
        puts the prompt: its text, its tokens' logprobs, and with ``return_token_ids`` its ids): the
        fields of a ``CompletionResponseChoice``, in its order (``_stream_chunk`` says why a dict)."""
        echo = first and request.echo
        shown = not request.echo_only  # else the prompt alone: the one token sampled is left out
        text = (prepared.text if echo else "") + (completion.text if shown else "")
        logprobs = None
        if request.logprobs is not None:
            # A position without logprobs is nulls rather than a shift of every later one.
            token_ids, positions = [], []
            if echo:
                token_ids += prepared.token_ids
                positions += prompt_logprobs or [None] * len(prepared.token_ids)
            if shown:
                token_ids += completion.token_ids
                positions += completion.logprobs or [None] * len(completion.token_ids)
            logprobs = self._completion_logprobs(request, token_ids, positions, text_offset)
        return {
            "index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "token_ids": (completion.token_ids if shown else []) if request.return_token_ids else None,
            "prompt_logprobs": _json_prompt_logprobs(prompt_logprobs) if not request.stream else None,
            "prompt_token_ids": prepared.token_ids if request.return_token_ids and first else None,
        }

    def _token_text(self, token_id: int, logprob: Logprob | None, as_id: bool) -> str:
        """A token as logprobs name it: "token_id:N" (``return_tokens_as_token_ids``), else its text."""
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}" if as_id else str(token_id)
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, request: CompletionRequest, token_ids: list[int], positions: list[dict | None],
                             text_offset: int) -> CompletionLogprobs:
        """OpenAI's legacy shape from the engine's logprobs (vLLM's: per position, token id -> Logprob,
        the position's own token first, then the top ones): each token's logprob and the position's first
        ``request.logprobs + 1`` entries, as vLLM gives them (``logprobs=0``: the token's own). A position
        without logprobs (the prompt's first token, when echoed) has nulls."""
        result = CompletionLogprobs()
        count = None if request.logprobs == -1 else request.logprobs + 1
        as_id = request.return_tokens_as_token_ids
        for token_id, position in zip(token_ids, positions):
            token = self._token_text(token_id, position and position.get(token_id), as_id)
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            if position is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(_json_logprob(position[token_id].logprob))
            result.top_logprobs.append({self._token_text(t, lp, as_id): _json_logprob(lp.logprob)
                                        for t, lp in itertools.islice(position.items(), count)})
        return result

    def _chat_logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                       logprobs: list[dict] | None) -> dict | None:
        """OpenAI's chat shape: each position's sampled token, and the ``request.top_logprobs`` best. The
        fields of a ``ChatChoiceLogprobs``, in its order (``_stream_chunk`` says why a dict)."""
        if not logprobs:
            return None
        top_n = request.top_logprobs or 0
        def entry(token_id: int, logprob: Logprob) -> dict:  # a ChatLogprob's fields
            token = self._token_text(token_id, logprob, request.return_tokens_as_token_ids)
            return {"token": token, "logprob": _json_logprob(logprob.logprob), "bytes": list(token.encode())}

        content = []
        for token_id, position in zip(token_ids, logprobs):
            sampled = entry(token_id, position[token_id])  # with its top ones, a ChatLogprobContent's fields
            sampled["top_logprobs"] = [entry(t, lp) for t, lp in position.items() if lp.rank <= top_n]
            content.append(sampled)
        return {"content": content}


class _ChatDeltas:
    """One streamed chat choice's deltas: its new text, or what its tool parser reads in it."""

    def __init__(self, tool_parser: ToolParser | None) -> None:
        self.tool_parser = tool_parser
        self.text = ""

    def delta(self, completion: CompletionOutput) -> tuple[dict | DeltaMessage | None, str | None]:
        """The delta for the choice's new output (a tool parser's ``DeltaMessage``, which pydantic writes as
        the dict of its fields), and its finish reason."""
        if self.tool_parser is None:
            return _delta_message(content=completion.text), completion.finish_reason
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


def _has_messages(body: bytes) -> bool:
    """Whether the body is a JSON object with a ``messages`` field (a body that is not JSON is not)."""
    try:
        parsed = pydantic_core.from_json(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and "messages" in parsed


def _json_setting(value):
    """A tokenizer setting as JSON: a special token (transformers' AddedToken) as its text."""
    if isinstance(value, dict):
        return {key: _json_setting(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_setting(item) for item in value]
    return getattr(value, "content", value)


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


async def _gather(outputs) -> RequestOutput:
    """The request's whole output, its sequences by index: its DELTA outputs folded into one. The
    prompt logprobs are the first given: with ``n > 1`` each sequence's request gives them."""
    whole = None
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            if whole is None:
                whole = output
                continue
            prompt_logprobs = whole.prompt_logprobs
            whole.add(output)
            whole.prompt_logprobs = prompt_logprobs or whole.prompt_logprobs
    whole.outputs.sort(key=lambda completion: completion.index)
    return whole


async def _merge(streams: list[AsyncGenerator[_T, None]]) -> AsyncGenerator[tuple[int, _T], None]:
    """The streams' items as they come, each with its stream's position; closing this closes them all."""
    if len(streams) == 1:
        # Nothing to merge (every chat request, most completions): iterating the stream itself spares
        # each item a task and a wait, a good share of the server's work per streamed token.
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    pending = {asyncio.ensure_future(anext(stream)): position for position, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                position = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[position]))] = position
                yield position, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # a stream is closed once it has stopped
        for stream in streams:
            await stream.aclose()


def _chat_role_chunk(request: ChatCompletionRequest, prepared: PreparedRequest, index: int, request_id: str,
                     created: int, model: str) -> dict:
    """A chat choice's first chunk: the role, and with ``return_token_ids`` the prompt's ids."""
    role = {"index": index, "delta": _delta_message(role="assistant", content=""), "logprobs": None,
            "finish_reason": None, "stop_reason": None, "token_ids": None}
    return _stream_chunk(True, request_id, created, model, [role],
                         _usage(len(prepared.token_ids), 0) if request.include_continuous_usage else None,
                         prepared.token_ids if request.return_token_ids else None)


def _delta_message(role: str | None = None, content: str | None = None) -> dict:
    """A ``DeltaMessage``'s fields, in its order, without tool calls (``_stream_chunk`` says why a dict)."""
    return {"role": role, "content": content, "tool_calls": None}


def _num_completion_tokens(request, completion: CompletionOutput) -> int:
    """The tokens a choice shows: none for ``echo`` with ``max_tokens=0``."""
    return 0 if isinstance(request, CompletionRequest) and request.echo_only else len(completion.token_ids)


def _json_prompt_logprobs(prompt_logprobs: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` field from the engine's, logprobs JSON cannot carry at the floor."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else {
        token_id: PromptLogprob(logprob=_json_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
        for token_id, lp in position.items()} for position in prompt_logprobs]


def _stream_chunk(chat: bool, request_id: str, created: int, model: str, choices: list[dict],
                  usage: UsageInfo | None, prompt_token_ids: list[int] | None = None) -> dict:
    """A stream's chunk: a ``ChatCompletionStreamResponse``'s fields in its order (chat), else a
    ``CompletionResponse``'s; its choices those of ``_chat_stream_choice`` or ``_completion_choice``.
    Plain dicts, which pydantic's serializer writes as it writes the models (tests/entrypoints/
    test_protocol.py checks it byte for byte): a stream makes one for every token of every request, and
    validating what the server made itself would take a good share of its time."""
    chunk = {"id": request_id, "created": created, "model": model,
             "object": "chat.completion.chunk" if chat else "text_completion", "choices": choices, "usage": usage}
    if chat:
        chunk["prompt_token_ids"] = prompt_token_ids
    return chunk


def _sse(response: BaseModel | dict) -> str:
    """A server-sent event of the JSON of a response model, or of a dict of its fields."""
    return f"data: {pydantic_core.to_json(response).decode()}\n\n"


def _usage(num_prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=num_prompt_tokens + completion_tokens)
