"""How one request chooses its next tokens. Pure Python: the scheduler reads it, the sampler obeys it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, validated on construction.

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 and ``top_p=1`` turn those filters off. A
    ``seed`` makes the request's samples reproducible whatever else shares its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} is not allowed; it must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} is not allowed; it must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} is not allowed; it must be >= 1, or 0 / -1 to turn it off")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is not allowed; it must be in (0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} is not allowed; it must be an integer or None")
        stop_ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is not allowed; it must hold token ids >= 0")
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
