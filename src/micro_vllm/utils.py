"""Where vLLM users import ``FlexibleArgumentParser`` from (``vllm.utils``); and helpers for signals
and processes: ``sigint_held_back``, for the few calls a Ctrl-C must not split; ``freeze_start_up_heap``
and ``heap_frozen``, which keep long-lived objects out of the garbage collector's scans; and
``exit_with_parent``, for a process that must not outlive the one that started it."""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: an option may be spelled with underscores as well as dashes
    (``--max_model_len 512`` is ``--max-model-len 512``), so that flags written for vLLM parse here.
    vLLM's YAML ``--config`` file and its dotted JSON options are not supported."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    """``--name_with_underscores[=value]`` with dashes in the name; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value


@contextmanager
def sigint_held_back() -> Iterator[None]:
    """Run the block with a Ctrl-C held back, then raise it: for a few short calls that an interrupt
    must not split, as it would at any bytecode of the main thread (one that takes a lock without a
    ``try``, a ``__del__`` that would swallow it, a command sent to some ranks and not the others).
    Python handles signals in the main thread only; elsewhere, or under a handler that was not set
    from Python, this changes nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    received = []
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        signal.raise_signal(signal.SIGINT)  # to the program's own handler: a KeyboardInterrupt by default


def freeze_start_up_heap() -> None:
    """Move every object that exists now out of the garbage collector's generations, for the rest of
    the process: for a process that is the engine's or a rank's, once its start-up is done. Start-up
    made most of what the process will ever hold (the model's modules, the tokenizer, compiled
    kernels, CUDA graphs), and each full collection that the steps' own objects set off would scan
    it all, stalling a step for as long as that takes; with ranks in collectives, every rank waits
    for the one stalled (vLLM freezes its heap after warm-up too). The objects are still freed by
    reference counting. Where the process is ours only for a while (a caller's ``LLM.generate``, an
    app's lifespan), ``heap_frozen`` freezes it for that while."""
    gc.collect()
    gc.freeze()


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Run the block with the objects that exist at its start out of the garbage collector's scans,
    then put them back. A full collection scans every tracked object, and an engine's process holds
    many (the model's modules, the tokenizer, compiled kernels, CUDA graphs), a server's too: a step
    or a response it falls in stalls for as long as that scan takes. The objects stay collectable:
    freed by reference counting as ever, and by the collector once the block ends."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def exit_with_parent() -> None:
    """End this process (at once, whatever its main thread is doing) as soon as the process that
    started it through ``multiprocessing`` is gone; nothing in a process that was not started so.
    A daemon thread waits for that."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait_for_parent() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=wait_for_parent, name="micro-vllm-parent-watch", daemon=True).start()
