"""Keeps the memory of a CPU step's large temporaries in the process, for the next step to reuse.

Each step allocates and frees the same large intermediates (a layer's activations over the step's
rows: megabytes at a prefill of a thousand tokens, a batch's logits). glibc's malloc gives large blocks
back to the kernel as soon as they are freed (blocks above its mmap threshold, and free memory at
the heap's top above its trim threshold), so every step asks the kernel for them again and pays a
page fault, and a kernel-zeroed page, for each 4 KiB it touches. Raising both thresholds once keeps
those blocks in malloc's free lists instead; the memory held stays bounded by the largest step's
temporaries. The setting is process-wide, as malloc is.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (half its heap size); blocks above it, such as
# the KV cache, still come straight from the kernel.
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30


def keep_step_memory() -> None:
    """Raise glibc's mmap and trim thresholds (a no-op elsewhere: other allocators keep their own)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.warning("glibc refused mallopt's thresholds; CPU steps will fault their temporaries in again")
