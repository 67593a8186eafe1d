import os

import torch

# Triton kernels run on CPU tensors only through its interpreter, which must be chosen before the
# kernels are defined: set it before any test imports the triton backend.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
