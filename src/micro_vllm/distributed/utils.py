"""Small helpers of tensor parallelism: even splits, the KV heads of a rank, and a free port for the
process group's store."""

from __future__ import annotations

import socket


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when it divides evenly; else a ValueError naming ``what`` (the
    quantity being split) and both numbers."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def num_kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """The KV heads each rank holds: an even share, or one when there are fewer KV heads than ranks
    (each then replicated over ``tp_size / total_num_kv_heads`` ranks, as vLLM does); a ValueError
    naming both numbers when neither divides the other."""
    if total_num_kv_heads >= tp_size:
        return divide(total_num_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % total_num_kv_heads:
        raise ValueError(f"num_key_value_heads={total_num_kv_heads} cannot be spread over "
                         f"tensor_parallel_size={tp_size}: one must be a multiple of the other")
    return 1


def get_open_port() -> int:
    """A TCP port on localhost that nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
