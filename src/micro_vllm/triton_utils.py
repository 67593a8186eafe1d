"""Whether Triton can run micro-vLLM's kernels on a device: checked once, when the engine starts."""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def check_triton_runs_on(device: torch.device, setting: str) -> None:
    """Raise a ValueError naming ``setting`` (say ``attention_backend='triton'``) unless Triton can
    run its kernels on ``device``: it must be installed, and on CPU tensors it runs only under its
    interpreter, which ``triton.jit`` picks when a kernel is defined."""
    if not HAS_TRITON:
        raise ValueError(f"{setting} needs Triton, which is not installed")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{setting} runs Triton kernels on the CPU, which only Triton's interpreter can do: set "
            "TRITON_INTERPRET=1 in the environment before triton is first imported (or use a GPU)"
        )
