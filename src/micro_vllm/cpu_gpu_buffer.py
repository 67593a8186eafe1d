"""A host buffer and its device twin, allocated once, for inputs a step stages on the host (vLLM's
``CpuGpuBuffer``)."""

from __future__ import annotations

from dataclasses import dataclass

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
        self._views: _Views | None = None  # those of the last call

    def copy_to_device(self, n: int, cols: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (of a 2-D buffer, only their first ``cols`` columns) and return
        the device rows."""
        views = self._views_of(n, cols)
        if views.copied_device is not None:
            views.copied_device.copy_(views.copied_host, non_blocking=True)
        return views.device

    def host_rows(self, n: int, cols: int | None = None) -> torch.Tensor:
        """The first ``n`` rows on the host (``cols`` as for the copy that goes with them)."""
        return self._views_of(n, cols).host

    def _views_of(self, n: int, cols: int | None) -> _Views:
        """The views of the first ``n`` rows: the last call's while ``n`` and ``cols`` repeat (the
        steps of one batch stage the same rows, and each slice is a torch call)."""
        views = self._views
        if views is None or views.n != n or views.cols != cols:
            host = self.cpu[:n]
            if self.device is self.cpu:
                views = _Views(n, cols, host, host, None, None)
            elif cols is None:
                device = self.device[:n]
                views = _Views(n, cols, host, device, host, device)
            else:
                views = _Views(n, cols, host, self.device[:n], self.cpu[:n, :cols], self.device[:n, :cols])
            self._views = views
        return views


@dataclass(frozen=True)
class _Views:
    """A buffer's first ``n`` rows on both sides, and the part of them a copy moves (None on CPU)."""

    n: int
    cols: int | None
    host: torch.Tensor
    device: torch.Tensor
    copied_host: torch.Tensor | None
    copied_device: torch.Tensor | None


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
