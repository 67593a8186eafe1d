"""What a request looks like to the user, in vLLM's shape: one ``RequestOutput`` per request, holding
one ``CompletionOutput`` per generated sequence (``SamplingParams.n`` of them, by ``index``)."""

from __future__ import annotations

from dataclasses import dataclass

from micro_vllm.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One generated sequence. ``finish_reason`` is "stop" (EOS, a stop token or a stop string),
    "length" (``max_tokens`` or ``max_model_len``) or "abort", and None while it runs;
    ``stop_reason`` is the stop string or stop token id that ended it, None for EOS or any other end.
    With ``SamplingParams.logprobs``, ``logprobs`` has a dict per token of ``token_ids`` and
    ``cumulative_logprob`` sums their logprobs; both None otherwise."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):
        # Pickled as its fields in order (RequestOutput's reason): unpickled by one call.
        return CompletionOutput, (self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                                  self.finish_reason, self.stop_reason)


@dataclass
class RequestOutput:
    """A request's output: the whole of it, or with ``RequestOutputKind.DELTA`` what is new since the
    last one. ``prompt`` is None for a prompt given as token ids; ``prompt_logprobs`` (with
    ``SamplingParams.prompt_logprobs``, else None) has an entry per prompt token, the first None, once
    the prompt is computed (a DELTA output gives them once); ``num_cached_tokens`` counts the prompt
    tokens served by the prefix cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int

    # The first sequence's text, token ids and finish reason under the names the project's first
    # API gave them (before outputs took vLLM's shape), so programs written for either run.
    @property
    def output_text(self) -> str:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def __reduce__(self):
        # Pickled as its fields in order: the engine's process sends the server hundreds a step, and
        # rebuilding one by a call to the class takes half the time that restoring its __dict__ does.
        return RequestOutput, (self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
                               self.outputs, self.finished, self.num_cached_tokens)

    def add(self, next_output: RequestOutput) -> None:
        """Fold the request's next DELTA output into this one, as if the two steps had been one: each
        sequence's new text, tokens and logprobs are appended, its finish taken from the later."""
        self.finished = next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + next_output.prompt_logprobs
        by_index = {completion.index: completion for completion in self.outputs}
        for new in next_output.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids  # new lists: the engine may still hold the old ones
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
