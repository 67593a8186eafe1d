"""Small helpers of tensor parallelism: even splits and a free port for the process group's store."""

from __future__ import annotations

import socket


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when it divides evenly; else a ValueError naming ``what`` (the
    quantity being split) and both numbers."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def get_open_port() -> int:
    """A TCP port on localhost that nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
