import importlib.util
import os
import time

import torch

# Triton kernels run on CPU tensors only through its interpreter, which must be chosen before the
# kernels are defined: set it before any test imports the triton backend, and patch the
# interpreter's deviations from the compiled kernels before any kernel runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread on CPU, in this process and the processes the tests start (examples, the CLI,
# servers, engine processes): the tests' tensors are small, and on a 2-core machine where another
# process holds a core, a second OpenMP thread waits at every barrier for a core, spinning meanwhile.
# OMP_NUM_THREADS set by hand wins.
if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from helpers.triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()


class _TestTimes:
    """Prints each test's time (setup, call and teardown together) and outcome as soon as it ends,
    with the clock time: a run cut short by a timeout (scripts/gpu_check.sh) still says where its
    time went, which --durations prints only at the end."""

    def __init__(self, config) -> None:
        self.config = config
        self.so_far: dict[str, tuple[float, str]] = {}

    def pytest_runtest_logreport(self, report) -> None:
        seconds, outcome = self.so_far.pop(report.nodeid, (0.0, "passed"))
        seconds += report.duration
        if outcome == "passed":
            outcome = report.outcome
        if report.when != "teardown":
            self.so_far[report.nodeid] = seconds, outcome
            return
        writer = self.config.pluginmanager.get_plugin("terminalreporter")._tw
        if writer.width_of_current_line:  # after -q's progress characters or -v's result
            writer.line()
        writer.line(f"[{time.strftime('%H:%M:%S')}] {seconds:7.1f} s {outcome:>7}  {report.nodeid}")


def pytest_configure(config) -> None:
    # MICRO_VLLM_TEST_TIMES=1 turns it on. Under pytest-xdist the reports reach the controlling
    # process, which prints them; its workers print nothing.
    if os.environ.get("MICRO_VLLM_TEST_TIMES") == "1" and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_TestTimes(config), "test-times")
