import importlib.util
import os

import torch

# Triton kernels run on CPU tensors only through its interpreter, which must be chosen before the
# kernels are defined: set it before any test imports the triton backend, and patch the
# interpreter's deviations from the compiled kernels before any kernel runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from helpers.triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()
