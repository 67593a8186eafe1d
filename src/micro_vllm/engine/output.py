"""What a finished request looks like to the user."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    finished: bool = True
