"""The test helpers' changes to Triton's CPU interpreter (helpers/triton_interpreter.py) compute what
the compiled kernels compute: Philox's rounds in numpy give Philox4x32-10's bits."""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.language import random as tl_random  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="patches the CPU interpreter only")


@triton.jit
def _philox_kernel(out_ptr, seed_ptr, counters_ptr, ROWS: tl.constexpr, SCALAR: tl.constexpr):
    """Philox of each row's four counters [ROWS, 4] under one 64-bit seed (the key's two halves),
    as scalars when SCALAR (one row), else as blocks of ROWS."""
    if SCALAR:
        offsets = 0
    else:
        offsets = tl.arange(0, ROWS) * 4
    counters = counters_ptr + offsets
    outputs = tl.philox(tl.load(seed_ptr), tl.load(counters), tl.load(counters + 1), tl.load(counters + 2),
                        tl.load(counters + 3))
    for i in tl.static_range(4):
        tl.store(out_ptr + offsets + i, outputs[i])


def philox(key: tuple[int, int], counters: np.ndarray) -> np.ndarray:
    """The uint32 outputs [rows, 4] of Philox4x32-10 with ``key`` (low, high word) over ``counters``."""
    seed = torch.tensor(np.array([key[1] << 32 | key[0]], dtype=np.uint64).view(np.int64))
    counters = torch.from_numpy(np.ascontiguousarray(counters, dtype=np.uint32).view(np.int32))
    out = torch.zeros_like(counters)
    _philox_kernel[(1,)](out, seed, counters, ROWS=len(counters), SCALAR=len(counters) == 1)
    return out.numpy().view(np.uint32)


# Random123's known answers for Philox4x32-10: (key, counter, output).
KNOWN_ANSWERS = [
    ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("key, counter, expected", KNOWN_ANSWERS)
def test_philox_gives_the_known_answers(key, counter, expected):
    assert philox(key, np.array([counter])).tolist() == [list(expected)]


def test_philox_in_numpy_gives_the_interpreted_rounds_bits(monkeypatch):
    counters = np.random.default_rng(0).integers(0, 2**32, (16, 4), dtype=np.uint32)
    key = (0x89ABCDEF, 0xFEDCBA98)
    patched = philox(key, counters)
    monkeypatch.setattr(tl_random, "philox_impl", tl_random.philox_impl.__wrapped__)
    assert patched.tolist() == philox(key, counters).tolist()
