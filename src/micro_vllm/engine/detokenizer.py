"""Turns one sequence's new token ids into text as they arrive, and ends it at a stop string.

One ``IncrementalDetokenizer`` per sequence (vLLM's name and method names). Each step the engine
hands it the sequence's new token ids; it extends ``output_text``, checks the stop strings on the new
text, and ``get_next_output_text`` gives the text to stream: the whole text so far (vLLM's
``CUMULATIVE``) or what is new since the last call (``DELTA``).

The text is what the tokenizer decodes, though decoding one token at a time is not: a character can
be split over several tokens (byte-level BPE, SentencePiece byte fallback), and SentencePiece drops
the leading space of the first token it decodes. The ``tokenizers`` library's ``DecodeStream`` (as in
vLLM's fast path) decodes a short window of recent tokens each step in Rust and gives what the
window's text gained; text that ends in U+FFFD (an incomplete character) is held back until the
character completes. It starts with a few prompt tokens, so the first output token keeps its leading
space. The text of a sequence is therefore ``decode(prompt + output)`` after ``decode(prompt)`` (for
byte-level BPE, ``decode(output)``), up to its last token after which the text was whole: when a
sequence ends inside a character, that character is not shown, nor the text of the tokens since the
last whole one (as in vLLM). Skipped special tokens never reach the stream: they add no text, and
the window would grow by each of them (a model that ignores EOS can give thousands).

Two limits, shared with vLLM. SentencePiece's decoder turns every byte of a run of byte tokens that
is not valid UTF-8 as a whole into U+FFFD, also the characters a stray byte follows, which the
stream has already given out. And vLLM's ``spaces_between_special_tokens`` has nothing to change:
the decoders of fast tokenizers put no spaces between tokens (transformers' ``decode`` ignores it).

Stop strings are matched on the text as it grows, across token boundaries. The text is cut where
the first stop string ends (before it, or after it with ``include_stop_str_in_output``), and the
rest of that step's text is dropped. "First" is the earliest end in the text, whatever the grouping
of tokens into steps; vLLM takes the first one listed among several that complete in one step, which
is the same unless two stops complete within one step. While streaming deltas, the last
``len(longest stop) - 1`` characters are held back, since they could be the start of a stop string
that must not be shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what decoders print for bytes that are not (yet) a whole character

# The prompt tokens the stream starts with: enough for SentencePiece's leading space, and searched
# back (up to the longer bound) for a start whose text is whole.
_PROMPT_CONTEXT_TOKENS = 4
_MAX_PROMPT_CONTEXT_TOKENS = 24


class IncrementalDetokenizer:
    """The text of one sequence, extended token by token, cut at its first stop string.

    ``min_tokens`` (SamplingParams') holds stop strings back: only text after that many tokens can
    end one. ``tokenizer=None`` or ``detokenize=False`` keeps token ids only: the text stays empty and stop
    strings are refused (they need text). ``update(..., stop_terminated=True)`` says the last new
    token is an EOS or stop token: its text is left out unless ``include_stop_str_in_output``, and no
    stop string is checked (the sequence ended on the token), as vLLM does.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        detokenize: bool = True,
        min_tokens: int = 0,
    ) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={stop!r} is not allowed; stop strings must be non-empty strings")
        self.detokenize = detokenize and tokenizer is not None
        if stop and not self.detokenize:
            raise ValueError(
                f"stop={stop!r} is not allowed with detokenize={detokenize!r} and "
                f"tokenizer={'None' if tokenizer is None else 'given'}; stop strings need text: "
                "a tokenizer and detokenize=True"
            )
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Characters that could still turn out to start an excluded stop string: not streamed yet.
        self.stop_buffer_length = max(map(len, stop)) - 1 if stop and not include_stop_str_in_output else 0

        self.token_ids: list[int] = []  # the output's token ids (all of them, also past a stop string)
        # The text as the steps gave it, joined only when read whole (``output_text``): extending one
        # string would copy all of it at every step, a cost that grows with the output.
        self._parts: list[str] = []
        self._length = 0  # characters in the parts
        self._last_output_text_offset = 0  # how much of the text the deltas have given out
        if not self.detokenize:
            return
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise TypeError(
                f"tokenizer={type(tokenizer).__name__} is not allowed; detokenizing needs a fast tokenizer "
                "(one backed by the tokenizers library, with a backend_tokenizer)"
            )
        self._tokenizer = backend
        self._skipped_ids = _special_token_ids(backend) if skip_special_tokens else frozenset()
        prompt_tail = prompt_token_ids[-_MAX_PROMPT_CONTEXT_TOKENS:]
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in _prompt_context(backend, [t for t in prompt_tail if t not in self._skipped_ids]):
            self._stream.step(backend, token_id)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def output_text(self) -> str:
        """The whole text so far (joined once, then kept as one part)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Appends the new tokens and their text; returns the stop string that ended it, if any."""
        self.token_ids.extend(new_token_ids)
        if not self.detokenize or not new_token_ids:
            return None
        text_token_ids = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            text_token_ids = new_token_ids[:-1]
        # The text of the first min_tokens tokens cannot end a stop string (vLLM's rule).
        num_held = min(max(self.min_tokens - (len(self.token_ids) - len(new_token_ids)), 0), len(text_token_ids))
        texts = [self._decode_next(token_id) for token_id in text_token_ids]
        if num_held:
            self._append("".join(texts[:num_held]))
        new = "".join(texts[num_held:])
        self._append(new)
        if stop_terminated or not self.stop:
            return None
        return self._check_stop_strings(len(new))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text so far, or with ``delta`` what is new since the last call; a finished sequence's
        text is given whole, an unfinished one's less the characters a stop string could still claim."""
        end = max(0, self._length - (0 if finished else self.stop_buffer_length))
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if end <= start:
            return ""
        self._last_output_text_offset = end
        return self._text_between(start, end)

    def _append(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._length += len(text)

    def _text_between(self, start: int, end: int) -> str:
        """``output_text[start:end]``, joined from the last parts back to the one holding ``start`` (a
        step's new text is in the last one or few)."""
        index, part_start = len(self._parts), self._length
        while part_start > start:
            index -= 1
            part_start -= len(self._parts[index])
        return "".join(self._parts[index:])[start - part_start:end - part_start]

    def _decode_next(self, token_id: int) -> str:
        """The text ``token_id`` adds: none while a character is incomplete, then all held back."""
        if token_id in self._skipped_ids:
            return ""
        return self._stream.step(self._tokenizer, token_id) or ""

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Cuts the text at the stop string that ends first in the new text; returns it."""
        if not num_new_chars:
            return None
        # Only a match that ends in the new text is new; it may start in the older text, at most the
        # longest stop string's length before it.
        offset = max(0, self._length - num_new_chars - max(map(len, self.stop)) + 1)
        text = self._text_between(offset, self._length)
        first: tuple[int, str] | None = None  # (end in ``text``, stop string)
        for stop in self.stop:
            start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if start != -1 and (first is None or start + len(stop) < first[0]):
                first = (start + len(stop), stop)
        if first is None:
            return None
        end, stop = first
        cut = offset + (end if self.include_stop_str_in_output else end - len(stop))
        self._parts, self._length = [self.output_text[:cut]], cut
        return stop


@lru_cache(maxsize=8)
def _special_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids ``skip_special_tokens`` skips; cached, as a tokenizer can have hundreds."""
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


def _prompt_context(tokenizer: Tokenizer, prompt: list[int]) -> list[int]:
    """The last few prompt tokens, back to where their text does not end in U+FFFD (the stream would
    hold that back and give it out with the first output text); none if the prompt ends inside a
    character."""
    for n in range(min(len(prompt), _PROMPT_CONTEXT_TOKENS), min(len(prompt), _MAX_PROMPT_CONTEXT_TOKENS) + 1):
        if not tokenizer.decode(prompt[-n:]).endswith(REPLACEMENT_CHAR):
            return prompt[-n:]
    return []


def decode_output(
    tokenizer: PreTrainedTokenizerBase,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
) -> str:
    """The text an ``IncrementalDetokenizer`` without stop strings holds after ``output_token_ids``,
    from one decode: what the output adds to the prompt's last few tokens, up to its last token after
    which the text is whole (usually the last token, so one decode)."""
    backend = tokenizer.backend_tokenizer
    skipped = _special_token_ids(backend) if skip_special_tokens else frozenset()
    context = _prompt_context(backend, [t for t in prompt_token_ids[-_MAX_PROMPT_CONTEXT_TOKENS:] if t not in skipped])
    prefix = backend.decode(context, skip_special_tokens=skip_special_tokens)
    output = list(output_token_ids)
    for end in range(len(output), 0, -1):
        text = backend.decode(context + output[:end], skip_special_tokens=skip_special_tokens)
        if not text.endswith(REPLACEMENT_CHAR):
            return text[len(prefix):]
    return ""
