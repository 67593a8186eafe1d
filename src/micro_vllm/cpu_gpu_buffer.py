"""A host buffer and its device twin, allocated once, for inputs a step stages on the host (vLLM's
``CpuGpuBuffer``)."""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    """Steps fill the host side with numpy and copy the used prefix over without blocking; on CPU both
    sides are the same tensor. The device side never moves, so a captured CUDA graph can read it.
    Before the host side is refilled, the previous step's copies must have finished (the runner waits
    for them once per step)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def copy_to_device(self, n: int, cols: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (of a 2-D buffer, only their first ``cols`` columns) and return
        the device rows."""
        if self.device is not self.cpu:
            index = (slice(n),) if cols is None else (slice(n), slice(cols))
            self.device[index].copy_(self.cpu[index], non_blocking=True)
        return self.device[:n]


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, queued without blocking: valid once the stream has run
    it (an event recorded after it). A tensor already on the host is returned as it is."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A one-off copy of a host array on the device, without blocking the host (through pinned
    memory on CUDA; on CPU the tensor shares the array's memory)."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor
