"""A process standing in for the server's engine process stuck in a step, for the test that its
parent's death ends it. Light to import: the parent that starts it imports nothing else."""

import threading


def stuck_engine_process() -> None:
    """Watch the parent as ``run_engine_core`` does, then never return (as a step that never ends)."""
    from micro_vllm.utils import exit_with_parent

    exit_with_parent()
    threading.Event().wait()
