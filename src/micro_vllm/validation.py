"""Checks for the values users hand the engine, shared by the configs, SamplingParams and prompts.

Each check raises ``ValueError`` naming the field, the value and what is allowed, and returns the
value normalized (numpy integers become ``int``), so that a bad value fails where it enters instead
of deep inside a step. Bools are refused wherever a number is expected: ``True`` is an ``int`` to
Python but never a meaningful count, id or probability.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

# The runner keeps token ids, lengths, block ids and top-k in int32 arrays, seeds in int64, and
# temperatures and top-p in float32: a value that does not fit would fail or wrap mid-step.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38

_MAX_REPR = 120


def short_repr(value: object) -> str:
    """``repr`` cut short, so that a long prompt does not flood an error message."""
    text = repr(value)
    return text if len(text) <= _MAX_REPR else f"{text[:_MAX_REPR]}...({len(text)} characters)"


def reject(name: str, value: object, allowed: str, error: type[Exception] = ValueError) -> Exception:
    """The error to raise for a bad ``value`` of ``name`` (TypeError for a wrong kind of object)."""
    return error(f"{name}={short_repr(value)} is not allowed; it must be {allowed}")


def is_int(value: object) -> bool:
    """An integer of any kind (Python or numpy), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int, high: int | None = INT32_MAX, allowed: str | None = None) -> int:
    """``value`` as an ``int`` in [low, high] (no upper bound when ``high`` is None)."""
    if not is_int(value) or value < low or (high is not None and value > high):
        raise reject(name, value, allowed or f"an integer {_int_range(low, high)}")
    return int(value)


def check_optional_int(name: str, value: object, low: int, high: int | None = INT32_MAX) -> int | None:
    if value is None:
        return None
    return check_int(name, value, low, high, allowed=f"None or an integer {_int_range(low, high)}")


def _int_range(low: int, high: int | None) -> str:
    return f">= {low}" if high is None else f"in [{low}, {high}]"


def check_float(
    name: str, value: object, low: float, high: float = FLOAT32_MAX, *, low_open: bool = False, allowed: str = ""
) -> float:
    """``value`` as a finite ``float`` in [low, high], or (low, high] with ``low_open``."""
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value > high
        or value < low
        or (low_open and value == low)
    ):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise reject(name, value, allowed or f"a finite number in {interval}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise reject(name, value, "True or False")
    return value


def check_str(name: str, value: object, allowed: str) -> str:
    if not isinstance(value, str) or not value:
        raise reject(name, value, allowed)
    return value


def check_field(config: object, name: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Check one field of a frozen dataclass in place: ``check(name, value, *args, **kwargs)``
    raises on a bad value, and the normalized value replaces the given one."""
    object.__setattr__(config, name, check(name, getattr(config, name), *args, **kwargs))
