"""How one request chooses its next tokens. Pure Python: the scheduler reads it, the sampler obeys it."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from micro_vllm.structured_output.params import StructuredOutputsParams
from micro_vllm.validation import (
    FLOAT32_MAX,
    INT32_MAX,
    INT64_MAX,
    check_bool,
    check_field,
    check_float,
    check_int,
    check_optional_int,
    is_int,
    reject,
)

logger = logging.getLogger(__name__)

# The most sequences one request may ask for (vLLM's default bound): each is a request of its own.
MAX_N = 16384

# A tiny positive temperature scales the logits towards float32 overflow (NaN scores, garbage tokens)
# while sampling all but greedily; vLLM raises temperatures below this to it with a
# warning, and so do we.
MIN_TEMPERATURE = 1e-2


class RequestOutputKind(enum.Enum):
    """Which outputs ``Engine.step`` returns for a request (vLLM's names): the whole output so far at
    every step that adds tokens, only what each such step adds, or one output when it finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, validated on construction.

    ``n`` sequences are generated for the prompt (parallel sampling, ``engine/parallel_sampling.py``):
    each samples on its own, and with a ``seed`` sequence ``i`` uses ``seed + i``.
    ``temperature=0`` means greedy; a positive temperature below 0.01 is raised to 0.01. ``top_k`` of
    0 or -1 and ``top_p=1`` turn those filters off (a ``top_k`` beyond the vocabulary keeps every
    token). A ``seed`` makes the request's samples reproducible whatever else shares its batch.

    A request stops at EOS (unless ``ignore_eos``), at any of ``stop_token_ids``, or where its text
    first contains any of the ``stop`` strings; the text is cut before the stop string, or after it
    with ``include_stop_str_in_output``. ``skip_special_tokens`` leaves special tokens out of the
    text; ``spaces_between_special_tokens`` is accepted for vLLM's sake and changes nothing (the
    detokenizer's docstring says why); ``detokenize=False`` gives token ids only (and no stop
    strings). ``output_kind`` says what ``Engine.step`` streams; ``LLM.generate`` uses FINAL_ONLY.

    The logits processors (vLLM's names, meanings and ranges; ``logits_processors.py`` applies them):
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) lower the logits of tokens the output
    already holds, once or per occurrence; ``repetition_penalty`` (> 0) divides the positive logits
    and multiplies the negative ones of tokens in the prompt or the output. ``min_p`` (in [0, 1])
    drops tokens less likely than ``min_p`` times the most likely one (after temperature).
    ``min_tokens`` holds back EOS, ``stop_token_ids`` and stop strings until that many tokens are
    out. ``logit_bias`` ({token id: bias in [-100, 100]}) adds to logits, ``allowed_token_ids`` bans
    every other token, and ``bad_words`` bans the last token of each word whenever the output ends
    with the rest of it (the word as the tokenizer splits it, alone and after a space). Token ids are
    checked against the model's vocabulary when the request is made.
    ``logprobs=k`` returns, for each output token, its log probability and those of the top k tokens
    (``CompletionOutput.logprobs``); ``prompt_logprobs=k`` the same for each prompt token after the
    first (``RequestOutput.prompt_logprobs``); -1 means the whole vocabulary. They are the model's raw
    log-softmax, before temperature or any filter, as vLLM's default; at most
    ``ModelConfig.max_logprobs`` (the engine checks it).
    ``structured_outputs`` constrains the output to a JSON schema, a regex, a choice or a grammar; the
    request stops once the output is complete (also under ``ignore_eos``).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        check_field(self, "n", check_int, 1, MAX_N)
        check_field(self, "max_tokens", check_int, 1, None)
        check_field(self, "temperature", _temperature)
        check_field(self, "top_k", check_int, -1, allowed=f"an integer in [1, {INT32_MAX}], or 0 / -1 to turn it off")
        check_field(self, "top_p", check_float, 0, 1, low_open=True)
        # Negative seeds are refused, not read as "no seed": None is the only way to say that.
        check_field(self, "seed", check_optional_int, 0, INT64_MAX)
        if self.seed is not None and self.seed > INT64_MAX - (self.n - 1):
            raise ValueError(
                f"seed={self.seed} is not allowed with n={self.n}; the sequences' seeds seed .. seed + n - 1 "
                f"must be at most {INT64_MAX}"
            )
        check_field(self, "ignore_eos", check_bool)
        check_field(self, "stop_token_ids", _stop_token_ids)
        check_field(self, "stop", _stop_strings)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            check_field(self, name, check_bool)
        for name in ("logprobs", "prompt_logprobs"):
            check_field(self, name, _num_logprobs)
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop={list(self.stop)!r} is not allowed with detokenize=False; stop strings are matched on the text"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise reject("output_kind", self.output_kind, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise reject("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        for name in ("presence_penalty", "frequency_penalty"):
            check_field(self, name, check_float, -2, 2)
        check_field(self, "repetition_penalty", check_float, 0, low_open=True)
        check_field(self, "min_p", check_float, 0, 1)
        max_min_tokens = min(self.max_tokens, INT32_MAX)
        check_field(self, "min_tokens", check_int, 0, max_min_tokens,
                    allowed=f"an integer in [0, {max_min_tokens}] (at most max_tokens={self.max_tokens})")
        check_field(self, "logit_bias", _logit_bias)
        check_field(self, "allowed_token_ids", _allowed_token_ids)
        check_field(self, "bad_words", _bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def bad_words_token_ids(bad_words: Iterable[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token ids of each bad word, as vLLM splits them: the word without its leading whitespace,
    and also after a space when that gives another first token in as many tokens (a word at the
    start of the text and one inside it may tokenize differently)."""
    sequences: list[tuple[int, ...]] = []
    for word in bad_words:
        word = word.lstrip()
        alone = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not alone:
            raise ValueError(f"bad_words contain {word!r} (after its leading spaces), which the tokenizer turns "
                             "into no token; each must give at least one")
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def _temperature(name: str, value: object) -> float:
    temperature = check_float(name, value, 0, allowed=f"a finite number in [0, {FLOAT32_MAX:g}] (0 means greedy)")
    if 0 < temperature < MIN_TEMPERATURE:
        logger.warning("%s=%r is below %r; using %r", name, temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
        return MIN_TEMPERATURE
    return temperature


def _num_logprobs(name: str, value: object) -> int | None:
    if value is None:
        return None
    return check_int(name, value, -1, allowed=f"None, -1 (the whole vocabulary) or an integer in [0, {INT32_MAX}]")


def _token_ids(value: object) -> tuple[int, ...] | None:
    """A list of token ids (integers >= 0) as a tuple, or None if it is not one."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        return None
    ids = tuple(value)
    return tuple(int(t) for t in ids) if all(is_int(t) and t >= 0 for t in ids) else None


def _stop_token_ids(name: str, value: object) -> tuple[int, ...]:
    ids = _token_ids(value)
    if ids is None:
        raise reject(name, value, "a list of token ids (integers >= 0)")
    return ids


def _allowed_token_ids(name: str, value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = _token_ids(value)
    if not ids:
        raise reject(name, value, "None or a non-empty list of token ids (integers >= 0)")
    return ids


def _logit_bias(name: str, value: object) -> dict[int, float] | None:
    if value is None:
        return None
    allowed = "None or a dict {token id (integer >= 0): bias (a finite number in [-100, 100])}"
    if not isinstance(value, Mapping):
        raise reject(name, value, allowed)
    try:
        return {check_int(name, token_id, 0, None): check_float(name, bias, -100, 100)
                for token_id, bias in value.items()}
    except ValueError:
        raise reject(name, value, allowed) from None


def _bad_words(name: str, value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    allowed = "None or a list of strings, each with a character other than whitespace"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise reject(name, value, allowed)
    words = tuple(value)
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise reject(name, value, allowed)
    return tuple(dict.fromkeys(words))  # each word once, as vLLM keeps them


def _stop_strings(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    allowed = "None, a non-empty string, or a list of non-empty strings"
    if isinstance(value, bytes) or not isinstance(value, Iterable):
        raise reject(name, value, allowed)
    stops = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(s, str) and s for s in stops):
        raise reject(name, value, allowed)
    return stops
