"""Tensor parallelism's process groups and collectives (vLLM's ``vllm.distributed``)."""

from micro_vllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from micro_vllm.distributed.utils import divide, get_open_port, num_kv_heads_per_rank

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "divide",
    "get_open_port",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "num_kv_heads_per_rank",
]
