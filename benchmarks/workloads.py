"""The throughput workloads, as prompt token ids and output lengths, for both engines.

Pure Python on purpose: ``throughput.py`` runs them on micro-vLLM and ``vllm_workloads.py`` on vLLM,
so the two engines get the very same requests. Every request but json-schema's ignores EOS, so the
output tokens are exactly ``sum(max_tokens)``. Token ids are drawn from 0..10,000 as in the recipe.

- ``recipe``: nano-vllm's bench (docs/benchmarks.md, "The recipe"): 256 prompts of 100 to 1,024
  random tokens, then 100 to 1,024 output tokens each, drawn in that order after seeding with 0.
- ``shared-prefix``: 256 requests that open with one 2,000-token system prompt, each followed by its
  own suffix of 100 to 1,024 tokens and asking for 100 to 1,024 output tokens. Drawn after seeding
  with 0: the system prompt, then the suffixes (each length, then its tokens), then the output
  lengths. Prefix caching decides it: the system prompt is 78% of the prompt tokens.
- ``long-context``: 32 prompts of 8,000 random tokens, 512 output tokens each: attention over long
  contexts dominates, and the prompts take most of the KV cache.
- ``long-context-prefill``: the same prompts with one output token each, the same ``max_model_len``:
  an engine's prefill of long-context alone, which splits its run into prefill and decode.
- ``json-schema``: the recipe's prompts, each answered by one JSON object of ``PRODUCT_SCHEMA``
  (structured output: xgrammar's token bitmask each step); it ends where the object does (``json_schema``).

The latency batches (``latency_prompts``, ``latency.py`` and ``vllm_workloads.py --latency``) are
not a throughput workload: 1, 8 and 64 prompts of 512 random tokens, arriving at once.

Both engines also take the same sampling settings (``--sampling-params``): fields of SamplingParams,
which both engines name alike, added to every request's (``request_settings``).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

MAX_TOKEN_ID = 10_000


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    max_model_len: int  # fits the longest prompt plus its output
    # Every request's output must be JSON this schema accepts, and EOS is not ignored; None: no
    # constraint, EOS ignored.
    json_schema: dict | None = None


def recipe(num_requests: int = 256, seed: int = 0) -> Workload:
    rng = random.Random(seed)  # the same draws as nano-vllm's random.seed(seed)
    prompts = [_tokens(rng, rng.randint(100, 1024)) for _ in range(num_requests)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_requests)]
    return Workload(prompts, max_tokens, max_model_len=4096)


def shared_prefix(num_requests: int = 256, prefix_len: int = 2000, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    system_prompt = _tokens(rng, prefix_len)
    prompts = [system_prompt + _tokens(rng, rng.randint(100, 1024)) for _ in range(num_requests)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_requests)]
    return Workload(prompts, max_tokens, max_model_len=prefix_len + 2048)


def long_context(num_requests: int = 32, prompt_len: int = 8000, output_len: int = 512, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [_tokens(rng, prompt_len) for _ in range(num_requests)]
    return Workload(prompts, [output_len] * num_requests, max_model_len=prompt_len + output_len)


def long_context_prefill(num_requests: int = 32, seed: int = 0) -> Workload:
    full = long_context(num_requests, seed=seed)
    return Workload(full.prompts, [1] * num_requests, max_model_len=full.max_model_len)


# A product record as an extraction request would ask for it: typed fields, an enum, bounded numbers,
# strings with a maxLength, arrays with maxItems, nested objects. Every part has a longest form, so the
# object always ends (see ``json_schema``).
PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "name": {"type": "string", "maxLength": 32},
        "category": {"enum": ["books", "electronics", "clothing", "garden", "toys"]},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "reviews": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                           "text": {"type": "string", "maxLength": 80}},
            "required": ["stars", "text"], "additionalProperties": False}},
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["id", "name", "category", "price", "in_stock", "tags", "reviews", "summary"],
    "additionalProperties": False,
}


def json_schema(num_requests: int = 256, seed: int = 0, max_tokens: int = 1024) -> Workload:
    """The recipe's prompts, each answered by one JSON object of ``PRODUCT_SCHEMA``: grammar-constrained
    decoding, in which each step fills every request's bitmask of allowed tokens on the host (xgrammar)
    and masks the logits with it.

    EOS is not ignored: the grammar allows EOS once the object is complete, and then nothing else, so a
    request ends with its object. ``max_tokens`` is only a cap: the schema bounds every string, number
    and array, so its objects are about 100 to 300 tokens on the benchmark checkpoint (whose tokenizer
    has JSON's characters, ``bench_model.JSON_PIECES``; its random weights choose among the allowed
    tokens at random). Only an object made mostly of ``\\uXXXX`` escapes, six tokens a character,
    could reach the cap. Throughput is the output tokens each engine made, over its seconds: the two
    engines sample different objects, so their token counts differ, and both are reported.
    """
    prompts = recipe(num_requests, seed).prompts
    return Workload(prompts, [max_tokens] * num_requests, max_model_len=1024 + max_tokens,
                    json_schema=PRODUCT_SCHEMA)


WORKLOADS = {"recipe": recipe, "shared-prefix": shared_prefix, "long-context": long_context,
             "long-context-prefill": long_context_prefill, "json-schema": json_schema}


LATENCY_BATCH_SIZES = (1, 8, 64)
LATENCY_PROMPT_LEN, LATENCY_OUTPUT_LEN = 512, 128
LATENCY_MAX_MODEL_LEN = 4096  # the engine's, on both sides


def latency_prompts(batch_size: int, prompt_len: int, run: int = 0,
                    max_token_id: int = MAX_TOKEN_ID) -> list[list[int]]:
    """A latency batch's prompts: its own for each batch size and run (so no run finds another's in the
    prefix cache), ids up to ``max_token_id`` (a small test model's vocabulary may end before 10,000)."""
    rng = random.Random(batch_size if run == 0 else f"{batch_size}-{run}")
    return [[rng.randint(0, max_token_id) for _ in range(prompt_len)] for _ in range(batch_size)]


def make_workload(name: str, num_requests: int | None = None) -> Workload:
    """The workload called ``name``, with its own number of requests unless one is given."""
    if name not in WORKLOADS:
        raise ValueError(f"workload={name!r} is not one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]() if num_requests is None else WORKLOADS[name](num_requests)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, MAX_TOKEN_ID) for _ in range(n)]


def sampling_settings(text: str) -> list[dict]:
    """``--sampling-params``: a JSON object of SamplingParams fields, or a JSON list of such objects
    (one setting each)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from e
    settings = value if isinstance(value, list) else [value]
    if not settings or not all(isinstance(s, dict) for s in settings):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of SamplingParams fields, "
                                         "or a non-empty list of them")
    return settings


def request_settings(settings: dict, index: int) -> dict:
    """The fields ``settings`` gives request ``index`` of a workload: the same for every request,
    but a ``seed`` seeds request i with ``seed + i``, so that each request is seeded (each engine
    then draws it from a generator, or a seed, of its own) and no two draw the same noise."""
    if settings.get("seed") is None:
        return settings
    return {**settings, "seed": settings["seed"] + index}
