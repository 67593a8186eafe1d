"""Workarounds for Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``), which runs the kernels in
the tests on machines without a GPU. conftest.py applies them before any kernel runs; compiled
kernels never see them."""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton.language as tl
from triton.language import random as tl_random
from triton.language.extra import libdevice
from triton.runtime import interpreter


def patch_triton_interpreter() -> None:
    """Make the interpreter compute what the compiled kernels compute, where Triton 3.6's does not.

    * It keeps a scalar as a 1-element array and converts it with ``int(array)``, which NumPy 2.4
      turned into a TypeError (triton-lang/triton#9171): any loop whose trip count comes from device
      data fails. ``.item()`` accepts any 1-element array.
    * ``tl.dot`` on bf16 multiplies the raw uint16 bit patterns it stores bf16 in, and comparisons of
      bf16 compare them (every negative value above every positive one); widen them to fp32.
    * It casts fp32 to bf16 by truncating the mantissa; the GPU rounds to nearest even, as PyTorch.
    * Its casts to float8 e4m3 lose the carry when rounding up crosses a power of two (0.49 becomes
      0.25) and flush subnormals; PyTorch's conversion is the GPU's, both ways.
    * ``libdevice`` functions are device code, which it cannot call: ``libdevice.exp`` (the kernels'
      ``expf``) becomes ``tl.exp``, which the interpreter computes with numpy in fp32.

    And three for speed: every call of a ``@triton.jit`` helper inside a kernel patches the language
    modules again, the very patches the launch made (a scan of every member of ``triton.language``),
    which took a third of the sampler's and the attention's interpreted time. Within a launch they
    are made once per module. The ten Philox rounds behind ``tl.rand`` (over a hundred interpreted
    operations a call, half of the sampler's interpreted time) run as numpy arrays. And the numpy
    dtype that holds a Triton type's values, which every interpreted operation asks for and the
    interpreter worked out anew each time from a table it built for the call, is kept per type.

    Each patch applies once, to the interpreter only, and is harmless once fixed upstream.
    """
    _patch_once(interpreter, "_patch_lang_tensor", _index_by_item)
    _patch_once(interpreter.InterpreterBuilder, "create_dot", _widen_bf16_operands)
    for comparison in _FLOAT_COMPARISONS:
        _patch_once(interpreter.InterpreterBuilder, comparison, _widen_bf16_operands)
    _patch_once(interpreter.InterpreterBuilder, "cast_impl", _round_fp32_to_bf16)
    _patch_once(interpreter.InterpreterBuilder, "create_fp_to_fp", _convert_fp8_as_torch)
    _patch_once(libdevice, "exp", lambda original: lambda x: tl.exp(x))
    _patch_once(interpreter, "_patch_lang", _patch_languages_once_per_launch)
    _patch_once(tl_random, "philox_impl", _philox_rounds_in_numpy)
    _patch_once(interpreter, "_get_np_dtype", _np_dtype_per_element_type)


def _patch_once(owner, name: str, make_patch) -> None:
    original = getattr(owner, name)
    if not getattr(original, "micro_vllm_patched", False):
        patched = make_patch(original)
        patched.micro_vllm_patched = True
        setattr(owner, name, patched)


def _index_by_item(patch_lang_tensor):
    def patch(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())

    return patch


_FLOAT_COMPARISONS = [f"create_fcmp{order}{relation}" for order in "OU"
                      for relation in ("LT", "GT", "LE", "GE", "EQ", "NE")]


def _widen_bf16_operands(create_op):
    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def patch(self, a, b, *args):
        return create_op(self, widen(a), widen(b), *args)

    return patch


def _round_fp32_to_bf16(cast_impl):
    def patch(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast_impl(self, src, dst_type)
        # bf16 is the upper half of an fp32: add just under half of the dropped half's range, plus
        # the kept lowest bit (ties to even), then drop it. Finite values too large become inf;
        # NaNs keep their sign and stay quiet NaNs.
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        data = np.where(is_nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
        return interpreter.TensorHandle(data, tl.bfloat16)

    return patch


# The interpreter keeps bf16 and fp8 values as their bit patterns (uint16, uint8).
_AS_TORCH = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
             tl.float32: torch.float32}
_SAME_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.float32}


def _convert_fp8_as_torch(create_fp_to_fp):
    def patch(self, src, dst_type, rounding_mode):
        src_type, dst_scalar = src.dtype.scalar, dst_type.scalar
        if tl.float8e4nv not in (src_type, dst_scalar):
            return create_fp_to_fp(self, src, dst_type, rounding_mode)
        data = np.ascontiguousarray(src.data)
        values = torch.from_numpy(data.reshape(-1)).view(_AS_TORCH[src_type]).reshape(data.shape)
        converted = values.to(_AS_TORCH[dst_scalar])
        bits = converted.view(_SAME_BITS[converted.element_size()]).numpy()
        return interpreter.TensorHandle(bits.view(interpreter._get_np_dtype(dst_scalar)), dst_scalar)

    return patch


def _patch_languages_once_per_launch(patch_lang):
    # Which of the language modules (tl, tl.core) the launch under way has patched; empty between
    # launches. A kernel launch patches what its kernel's globals hold and undoes it at its end; a
    # helper called inside it needs only the modules its own globals hold.
    patched: set[str] = set()

    def languages(fn) -> set[str]:
        modules = fn.__globals__.values()
        return {name for name, module in (("tl", tl), ("tl.core", tl.core)) if any(m is module for m in modules)}

    def patch(fn):
        needed = languages(fn)
        if patched and needed <= patched:  # a helper inside the launch: nothing left to patch
            return interpreter._LangPatchScope()
        launch = not patched
        scope = patch_lang(fn)
        patched.update(needed)
        if launch:  # the launch's own scope: its end starts the next launch afresh
            restore = scope.restore

            def restore_and_forget() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    return patch


def _philox_rounds_in_numpy(philox_impl):
    # Philox4x32-10 as Triton's philox_impl computes it: 32-bit products are exact in uint64, their
    # high and low halves are umulhi and the wrapping product. 64-bit counters keep the interpreted rounds.
    round_a, round_b, key_a, key_b, low = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF

    @functools.wraps(philox_impl)
    def patch(c0, c1, c2, c3, k0, k1, n_rounds=tl_random.N_ROUNDS_DEFAULT):
        if c0.dtype != tl.uint32:
            return philox_impl(c0, c1, c2, c3, k0, k1, n_rounds)
        operands = (c0, c1, c2, c3, k0, k1)
        shape = np.broadcast_shapes(*(tuple(tl.core._unwrap_if_constexpr(d) for d in x.shape) for x in operands))
        c0, c1, c2, c3, k0, k1 = (np.asarray(x.handle.data, dtype=np.uint64) for x in operands)
        for _ in range(tl.core._unwrap_if_constexpr(n_rounds)):
            product_a, product_b = round_a * c0, round_b * c2
            c0, c1, c2, c3 = (product_b >> 32) ^ c1 ^ k0, product_b & low, (product_a >> 32) ^ c3 ^ k1, product_a & low
            k0, k1 = (k0 + key_a) & low, (k1 + key_b) & low
        # A scalar stays the interpreter's 1-element array; a block takes the operands' broadcast shape.
        result_type = tl.block_type(tl.uint32, list(shape)) if shape else tl.uint32
        return tuple(tl.tensor(interpreter.TensorHandle(np.broadcast_to(x, shape or x.shape).astype(np.uint32),
                                                        tl.uint32), result_type) for x in (c0, c1, c2, c3))

    return patch


def _np_dtype_per_element_type(get_np_dtype):
    # A block's values are held as its element type's; pointer types (unhashable) are all uint64.
    per_element_type = functools.cache(get_np_dtype)

    def patch(tt_dtype):
        element_type = tt_dtype.scalar
        if isinstance(element_type, tl.pointer_type):
            return get_np_dtype(element_type)
        return per_element_type(element_type)

    return patch
