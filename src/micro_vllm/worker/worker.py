"""One device: picks the device, dtype and backend, owns the ModelRunner, and sizes the KV cache.

Under tensor parallelism there is one Worker per rank, each in its own process (``MultiprocExecutor``):
rank r runs on cuda:r (on CPU, on the cores its process is given), and joins the ranks' process groups
before it builds its slice of the model. Rank r of data-parallel replica d runs on
cuda:(d * tensor_parallel_size + r).
"""

from __future__ import annotations

import logging

import torch

from micro_vllm.attention.backends.registry import BackendUnavailableError, backends_supporting, get_backend_cls
from micro_vllm.config import LLMConfig
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.distributed import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from micro_vllm.layers.custom_op import resolve_custom_ops
from micro_vllm.models.utils import head_size_of
from micro_vllm.outputs import AsyncModelRunnerOutput
from micro_vllm.triton_utils import check_triton_runs_on
from micro_vllm.worker.dummy_run import profile_run
from micro_vllm.worker.model_runner import ModelRunner, RunnerSettings

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} is not available: this machine has no CUDA device; use 'cpu'")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:  # name the card, so set_device accepts it
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str, device: torch.device, hf_config) -> torch.dtype:
    """'auto' means fp32 on CPU (fast and exact there) and the checkpoint's half type on CUDA (bf16
    when the checkpoint is fp32). float16 on CPU runs in float32, with a warning: on a CPU without
    native 16-bit matmuls (most of them) a float16 model runs several times slower than in float32,
    and bfloat16, vLLM's choice for float16 models on CPU, is as slow there."""
    if dtype == "float16" and device.type == "cpu":
        logger.warning("float16 is slow on CPU; running the model in float32 instead")
        return torch.float32
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    # transformers 5 calls it dtype; older configs torch_dtype (reading that name in 5 warns).
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """'auto' stores K/V in the model's dtype; 'fp8' and 'fp8_e4m3' in float8 e4m3."""
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def resolve_attention_backend(backend: str | None, device: torch.device, head_size: int) -> str:
    """The chosen backend, which must serve the model's heads; by default triton on CUDA (when
    Triton is installed and serves them) and sdpa elsewhere."""
    if backend is not None:
        if not get_backend_cls(backend).supports_head_size(head_size):
            raise ValueError(
                f"attention_backend={backend!r} cannot serve this model's head size {head_size}; "
                f"choose one of {backends_supporting(head_size)}"
            )
        if backend == "triton":
            check_triton_runs_on(device, "attention_backend='triton'")
        return backend
    if device.type == "cuda":
        try:
            triton_backend = get_backend_cls("triton")
        except BackendUnavailableError:
            return "sdpa"
        if triton_backend.supports_head_size(head_size):
            return "triton"
        logger.warning("the triton attention backend cannot serve head size %d; using sdpa", head_size)
    return "sdpa"


def init_worker_distributed_environment(world_size: int, rank: int, distributed_init_method: str | None,
                                        device: torch.device) -> None:
    """Join the ranks' world at ``distributed_init_method``, one rank included, and set the
    tensor-parallel group: activations over NCCL on CUDA, gloo on CPU. Its first collective runs
    here, before any CUDA graph is captured. The in-process executor's worker (no address) joins none."""
    if distributed_init_method is None:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_distributed_environment(world_size, rank, distributed_init_method, backend)
    initialize_model_parallel(world_size, backend)
    get_tp_group().warm_up(device)


class Worker:
    """``rank`` of ``config.parallel_config``'s ranks, which meet at ``distributed_init_method``
    (a ``tcp://`` address; None for the in-process executor's one rank, in no process group)."""

    def __init__(self, config: LLMConfig, model_path, hf_config, max_model_len: int, rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        model_config = config.model_config
        parallel_config = config.parallel_config
        world_size = parallel_config.world_size
        device = resolve_device(model_config.device)
        if device.type == "cuda" and world_size * parallel_config.data_parallel_size > 1:
            # Replica r's ranks take the devices from r * world_size on (ParallelConfig).
            device = torch.device("cuda", parallel_config.data_parallel_rank * world_size + rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_worker_distributed_environment(world_size, rank, distributed_init_method, device)
        dtype = resolve_dtype(model_config.dtype, device, hf_config)
        kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, dtype)
        backend = resolve_attention_backend(model_config.attention_backend, device, head_size_of(hf_config))
        # Graphs need a backend that reads step sizes from the device, not from the host.
        use_graphs = device.type == "cuda" and not model_config.enforce_eager and get_backend_cls(backend).cuda_graph_safe
        self.settings = RunnerSettings(
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=backend,
            custom_ops=resolve_custom_ops(model_config.custom_ops, device),
            max_model_len=max_model_len,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            block_size=config.cache_config.block_size,
            seed=model_config.seed,
            use_cuda_graphs=use_graphs,
            load_format=model_config.load_format,
        )
        self.model_runner = ModelRunner(self.settings, model_path, hf_config)

    def determine_num_blocks(self, max_blocks_per_request: int) -> int:
        """How many KV blocks fit: an explicit ``num_blocks`` wins; on CUDA what is left of
        ``gpu_memory_utilization`` after a profiling run and the memory the runner allocates on
        demand (``ModelRunner.on_demand_bytes``); on CPU the ``cpu_kv_cache_gib`` budget,
        capped at what the scheduler could ever use (``max_num_seqs`` requests holding
        ``max_blocks_per_request`` each, over all KV cache groups)."""
        cache_config = self.config.cache_config
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block()
        settings = self.settings
        if settings.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            profile_run(self.model_runner)
            torch.cuda.synchronize()
            activation_peak = torch.cuda.max_memory_allocated() - before
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            available = (total * cache_config.gpu_memory_utilization - (total - free) - activation_peak
                         - self.model_runner.on_demand_bytes())
            num_blocks = int(available // bytes_per_block)
            logger.info("KV cache: %d blocks (%.1f GiB)", num_blocks, num_blocks * bytes_per_block / 2**30)
        else:
            budget = int(cache_config.cpu_kv_cache_gib * 2**30 // bytes_per_block)
            num_blocks = min(budget, settings.max_num_seqs * max_blocks_per_request + 1)
        num_blocks = get_tp_group().all_reduce_min(num_blocks)  # every rank's cache holds the same blocks
        if num_blocks < 2:
            raise ValueError(
                f"no room for the KV cache: {num_blocks} blocks fit; raise gpu_memory_utilization or "
                f"cpu_kv_cache_gib, or lower max_num_batched_tokens"
            )
        return num_blocks

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(groups, num_blocks)

    def execute_model(self, plan: SchedulerOutput) -> AsyncModelRunnerOutput:
        return self.model_runner.execute_model(plan)

    def reset_batch(self) -> None:
        self.model_runner.reset_batch()

    def shutdown(self) -> None:
        """Leave the ranks' process groups (nothing to leave for one rank)."""
        destroy_model_parallel()
        destroy_distributed_environment()
