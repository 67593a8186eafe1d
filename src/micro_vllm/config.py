"""Typed, validated configuration: what the user asks for, checked before any work starts.

Configs are frozen; values that depend on the machine or the checkpoint ("auto" device, dtype,
backend) are resolved by the layer that owns them (the Worker), not written back here.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any

from micro_vllm.validation import (
    INT32_MAX,
    INT64_MAX,
    check_bool,
    check_field,
    check_float,
    check_int,
    check_optional_int,
    check_str,
    is_int,
    reject,
)

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 means e4m3, as on CUDA in vLLM
# vLLM's load formats that apply here: "auto" and "safetensors" read the checkpoint's *.safetensors;
# "dummy" gives random weights of the right shapes and dtypes, no weight files needed (benchmarks).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# The ops with a Triton implementation beside their PyTorch one, as ``custom_ops`` names them: the
# layers' CustomOps (layers/custom_op.py) and the sampler's route. fused_qk_norm_rope does qk_norm's
# and rotary_embedding's work in one kernel, and runs it only where both of theirs are enabled too.
CUSTOM_OPS = ("rms_norm", "qk_norm", "rotary_embedding", "fused_qk_norm_rope", "silu_and_mul", "sampler")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run, where, and how its attention is computed."""

    model: str
    tokenizer: str | None = None  # defaults to the model directory
    device: str = "auto"  # "auto" picks cuda when present, else cpu
    dtype: Any = "auto"  # a torch.dtype or one of _DTYPES; auto: bf16 on CUDA, fp32 on CPU
    attention_backend: str | None = None  # reference | sdpa | triton; None picks per device
    seed: int = 0
    enforce_eager: bool = False  # True turns CUDA graphs off
    # Which ops of CUSTOM_OPS run their Triton kernel (vLLM's compilation_config.custom_ops). The
    # default is all of them on CUDA when Triton is installed, none elsewhere; "all" or "none"
    # replaces it, then "+op" turns an op on and "-op" off. None keeps the default.
    custom_ops: list[str] | None = None
    # The most logprobs (or prompt logprobs) a request may ask for (vLLM's name and default); -1: the
    # whole vocabulary.
    max_logprobs: int = 20
    # vLLM's hf_overrides: a dict of Hugging Face config attributes to set, or a function that takes
    # the model's config and returns the one to use; applied before the model is built. Left out of
    # the hash: a dict has none.
    hf_overrides: Any = field(default=None, hash=False)
    load_format: str = "auto"  # one of LOAD_FORMATS
    # Where LLM.get_default_sampling_params() takes its defaults (vLLM's generation_config): "auto"
    # from the model's generation_config.json, "vllm" from SamplingParams alone, or a directory
    # holding a generation_config.json.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        check_str("model", self.model, "a model directory or a hub id (a non-empty string)")
        if self.tokenizer is not None:
            check_str("tokenizer", self.tokenizer, "None or a tokenizer directory (a non-empty string)")
        dtype = self.dtype if isinstance(self.dtype, str) else str(self.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise reject("dtype", self.dtype, f"a torch.dtype or one of {_DTYPES}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise reject("device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.attention_backend is not None:
            check_str("attention_backend", self.attention_backend, "None or a backend name")
        check_field(self, "seed", check_int, 0, INT64_MAX)
        check_field(self, "enforce_eager", check_bool)
        check_field(self, "custom_ops", _check_custom_ops)
        check_field(self, "max_logprobs", check_int, -1, allowed=f"-1 (the whole vocabulary) or an integer in "
                    f"[0, {INT32_MAX}]")
        if not (self.hf_overrides is None or callable(self.hf_overrides) or (
            isinstance(self.hf_overrides, dict) and all(isinstance(key, str) for key in self.hf_overrides)
        )):
            raise reject("hf_overrides", self.hf_overrides, "None, a dict with string keys, or a function that "
                         "takes and returns a transformers PretrainedConfig")
        if self.load_format not in LOAD_FORMATS:
            raise reject("load_format", self.load_format, f"one of {LOAD_FORMATS}")
        check_str("generation_config", self.generation_config,
                  "'auto', 'vllm' or a directory holding a generation_config.json")


def _check_custom_ops(name: str, value: Any) -> tuple[str, ...] | None:
    """``value`` as a tuple (the config stays hashable), each entry one vLLM accepts: "all", "none",
    "+op" or "-op" for an op of CUSTOM_OPS, and no op (nor "all"/"none") both on and off."""
    if value is None:
        return None
    allowed = f"None or a list of 'all', 'none', '+op' and '-op' entries, op one of {list(CUSTOM_OPS)}"
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise reject(name, value, allowed)
    for entry in value:
        if not isinstance(entry, str) or (entry not in ("all", "none") and not (
            entry[:1] in ("+", "-") and entry[1:] in CUSTOM_OPS
        )):
            raise reject(name, value, f"{allowed} (not {entry!r})")
    for on, off in [("all", "none"), *((f"+{op}", f"-{op}") for op in CUSTOM_OPS)]:
        if on in value and off in value:
            raise reject(name, value, f"{allowed}, without both {on!r} and {off!r}")
    return tuple(value)


@dataclass(frozen=True)
class SchedulerConfig:
    """The budgets of one engine step (vLLM's names and meanings)."""

    max_model_len: int | None = None  # prompt + output; None takes the model's max_position_embeddings
    # vLLM's defaults for offline use on a large GPU: room for every request of a big batch at once.
    max_num_batched_tokens: int = 16384  # tokens computed in one step, prefill chunks and decodes together
    max_num_seqs: int = 1024  # requests running at once
    enable_chunked_prefill: bool = True
    # Plan step N+1 while the device runs step N; a request that stops early costs one wasted token.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        check_field(self, "max_model_len", check_optional_int, 1)
        check_field(self, "max_num_batched_tokens", check_int, 1)
        check_field(self, "max_num_seqs", check_int, 1)
        check_field(self, "enable_chunked_prefill", check_bool)
        check_field(self, "async_scheduling", check_bool)
        if self.max_model_len is not None:
            self.verify_max_model_len(self.max_model_len)

    def verify_max_model_len(self, max_model_len: int) -> None:
        """Refuse a budget that cannot make progress: without chunked prefill a prompt is computed in
        one step, so the step budget must hold the longest. Checked here when ``max_model_len`` is
        given, and by the engine when it comes from the model."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is too small to make progress: without "
                f"chunked prefill it must be >= max_model_len ({max_model_len})"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, how much memory it takes, prefix caching."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use in all
    num_blocks: int | None = None  # an explicit capacity, overriding the sizing
    cpu_kv_cache_gib: float = 4.0  # the KV budget on CPU
    enable_prefix_caching: bool = True
    # auto: K/V stored in the model's dtype; fp8 (= fp8_e4m3): one byte per value, so twice the
    # blocks of bf16 in the same memory and half the bytes each decode step reads.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        bs = self.block_size
        if not is_int(bs) or not 1 <= bs <= INT32_MAX or bs & (bs - 1):
            raise reject("block_size", bs, "a positive power of two")
        check_field(self, "gpu_memory_utilization", check_float, 0, 1, low_open=True)
        check_field(self, "num_blocks", check_optional_int, 2)
        check_field(self, "cpu_kv_cache_gib", check_float, 0, low_open=True)
        check_field(self, "enable_prefix_caching", check_bool)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise reject("kv_cache_dtype", self.kv_cache_dtype, f"one of {KV_CACHE_DTYPES}")


EXECUTOR_BACKENDS = ("mp", "ray", "uni")  # vLLM's names


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices (vLLM's names): ``tensor_parallel_size`` ranks, each
    holding a slice of every layer, and the executor that runs them: "uni" (one rank, in the
    engine's process), "mp" (one process per rank) or "ray" (one Ray actor per rank, on one node or
    several; Ray is an optional dependency). None picks "uni" for one rank, else "mp".

    ``data_parallel_size`` whole copies of the model (replicas) serve requests side by side, each an
    engine of its own with its own tensor-parallel ranks (``engine/data_parallel.py``);
    ``data_parallel_rank`` is the replica an engine is, set for each by the server's front end. On
    CUDA replica r's ranks run on devices r * tensor_parallel_size onwards."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        check_field(self, "tensor_parallel_size", check_int, 1)
        check_field(self, "data_parallel_size", check_int, 1)
        check_field(self, "data_parallel_rank", check_int, 0, self.data_parallel_size - 1)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise reject("distributed_executor_backend", backend, f"None or one of {EXECUTOR_BACKENDS}")
        if backend == "ray" and self.data_parallel_size > 1:  # Ray's GPU placement knows nothing of replicas
            raise reject("distributed_executor_backend", backend, f"'mp', 'uni' or None with data_parallel_size="
                         f"{self.data_parallel_size}: replicas on Ray are not built")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                             "pip install 'micro-vllm[ray]' (from a checkout: pip install -e '.[ray]')")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise reject("distributed_executor_backend", backend, f"'mp', 'ray' or None: 'uni' runs one rank and "
                         f"tensor_parallel_size is {self.tensor_parallel_size}")
        if backend is None:
            object.__setattr__(self, "distributed_executor_backend", "uni" if self.tensor_parallel_size == 1 else "mp")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class LLMConfig:
    """Everything an engine needs, grouped the way vLLM groups it (``EngineArgs`` gives the same
    settings flat, as keywords and command line flags)."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    trace: Any = None  # a JSON-lines path or an object with emit(event); None turns tracing off

    def __post_init__(self) -> None:
        for name, section_cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), section_cls):
                raise reject(name, getattr(self, name), f"a {section_cls.__name__}")
        device, ranks = self.model_config.device, self.parallel_config.tensor_parallel_size
        if ranks > 1 and device.startswith("cuda:"):
            raise reject("device", device, f"'auto' or 'cuda' with tensor_parallel_size={ranks}: rank r runs on "
                         "cuda:r")
        replicas = self.parallel_config.data_parallel_size
        if replicas > 1 and device.startswith("cuda:"):
            raise reject("device", device, f"'auto' or 'cuda' with data_parallel_size={replicas}: replica r runs "
                         "on the devices from cuda:(r * tensor_parallel_size)")


_SECTIONS = {"model_config": ModelConfig, "scheduler_config": SchedulerConfig, "cache_config": CacheConfig,
             "parallel_config": ParallelConfig}
