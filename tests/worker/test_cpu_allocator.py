"""keep_step_memory: a freed large block is reused by the next allocation instead of being faulted in again."""

import platform
import subprocess
import sys

import pytest

# In a fresh process (malloc's thresholds at their defaults), allocate and touch an 8 MiB array twice;
# print the page faults the second one took.
SCRIPT = """
import resource, sys
import numpy as np
from micro_vllm.worker.cpu_allocator import keep_step_memory
if sys.argv[1] == "keep":
    keep_step_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(2**21, np.float32)
before = faults()
np.ones(2**21, np.float32)
print(faults() - before)
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_step_memory_is_reused():
    def second_allocation_faults(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                                  check=True).stdout)

    kept = second_allocation_faults("keep")
    assert kept <= 2**23 // 4096 // 100
    assert second_allocation_faults("default") > kept  # malloc's defaults give the block back and fault it in again
