"""Workarounds for Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``), which runs the kernels in
tests on machines without a GPU. Nothing here touches compiled kernels."""

from __future__ import annotations

import triton.language as tl


def interpreted(kernel) -> bool:
    """Whether ``kernel`` runs under the interpreter: ``triton.jit`` decides when the kernel is
    defined (from TRITON_INTERPRET at that moment), so ask the kernel, not the environment."""
    return type(kernel).__name__ == "InterpretedFunction"


def patch_triton_interpreter() -> None:
    """Work around two bugs of Triton 3.6's CPU interpreter that our kernels hit.

    * It keeps a scalar as a 1-element array and converts it with ``int(array)``, which NumPy 2.4
      turned into a TypeError (triton-lang/triton#9171): any loop whose trip count comes from device
      data fails. ``.item()`` accepts any 1-element array.
    * ``tl.dot`` on bf16 multiplies the raw uint16 bit patterns it stores bf16 in; widen them to fp32.

    Both patches are idempotent, apply to the interpreter only, and are harmless once fixed upstream.
    """
    import numpy as np
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is not None and not getattr(patch_tensor, "micro_vllm_fixed", False):

        def patch_lang_tensor(tensor, scope) -> None:
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())

        patch_lang_tensor.micro_vllm_fixed = True
        interpreter._patch_lang_tensor = patch_lang_tensor

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is not None and not getattr(create_dot, "micro_vllm_fixed", False):

        def widen(handle):
            if handle.dtype.scalar == tl.bfloat16:
                bits = handle.data.astype(np.uint32) << 16
                return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
            return handle

        def create_dot_widened(self, a, b, *args):
            return create_dot(self, widen(a), widen(b), *args)

        create_dot_widened.micro_vllm_fixed = True
        builder.create_dot = create_dot_widened
