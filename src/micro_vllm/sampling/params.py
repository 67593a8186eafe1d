"""How one request chooses its next tokens. Pure Python: the scheduler reads it, the sampler obeys it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from micro_vllm.validation import (
    FLOAT32_MAX,
    INT32_MAX,
    INT64_MAX,
    check_bool,
    check_float,
    check_int,
    check_optional_int,
    is_int,
    reject,
)

logger = logging.getLogger(__name__)

# Below this a positive temperature only rescales the logits towards overflow, not towards anything
# greedier; vLLM raises such temperatures to it with a warning, and so do we.
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, validated on construction.

    ``temperature=0`` means greedy; a positive temperature below 0.01 is raised to 0.01. ``top_k`` of
    0 or -1 and ``top_p=1`` turn those filters off (a ``top_k`` beyond the vocabulary keeps every
    token). A ``seed`` makes the request's samples reproducible whatever else shares its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        temperature = check_float(
            "temperature", self.temperature, 0, allowed=f"a finite number in [0, {FLOAT32_MAX:g}] (0 means greedy)"
        )
        if 0 < temperature < MIN_TEMPERATURE:
            logger.warning("temperature=%r is below %r; using %r", temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            temperature = MIN_TEMPERATURE
        checked = {
            "max_tokens": check_int("max_tokens", self.max_tokens, 1, None),
            "temperature": temperature,
            "top_k": check_int("top_k", self.top_k, -1, allowed=f"an integer in [1, {INT32_MAX}], or 0 / -1 to turn it off"),
            "top_p": check_float("top_p", self.top_p, 0, 1, low_open=True),
            # Negative seeds are refused, not read as "no seed": None is the only way to say that.
            "seed": check_optional_int("seed", self.seed, 0, INT64_MAX),
            "ignore_eos": check_bool("ignore_eos", self.ignore_eos),
            "stop_token_ids": _stop_token_ids(self.stop_token_ids),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _stop_token_ids(value: object) -> tuple[int, ...]:
    allowed = "a list of token ids (integers >= 0)"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise reject("stop_token_ids", value, allowed)
    ids = tuple(value)
    if not all(is_int(t) and t >= 0 for t in ids):
        raise reject("stop_token_ids", value, allowed)
    return tuple(int(t) for t in ids)
