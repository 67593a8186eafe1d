"""What the Engine asks of the device side: the Executor interface that every executor implements.

The Engine holds one ``Executor`` and calls only these methods, so where the workers run (in the
Engine's process, or in processes of their own) is hidden from the scheduler and the request lifecycle.
The Engine calls them in this order: ``get_attention_specs``, ``determine_num_blocks`` and
``initialize_kv_cache`` once at start-up; then ``execute_model`` once per step, ``reset_batch``
after a failed step, and ``shutdown`` last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.outputs import AsyncModelRunnerOutput


class Executor(ABC):
    """Runs the scheduler's plans on the model's device(s) and hands back the sampled tokens."""

    @abstractmethod
    def get_attention_specs(self) -> list[AttentionSpec]:
        """The ``AttentionSpec`` of every attention layer of the model, in layer order; the Engine
        groups the layers into KV cache groups by it."""

    @abstractmethod
    def determine_num_blocks(self, max_blocks_per_request: int) -> int:
        """How many KV cache blocks each layer gets: ``CacheConfig.num_blocks`` when given, else as many
        as the cache budget holds, which may stop at what the scheduler could ever use
        (``max_num_seqs`` requests of ``max_blocks_per_request`` blocks each, over all groups).
        Raises ValueError when fewer than two blocks fit (one is the null block)."""

    @abstractmethod
    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        """Allocate the paged KV cache (``num_blocks`` blocks for every attention layer, laid out by
        ``groups``) and whatever the steps need (on CUDA also the warm-up and the CUDA graphs), so
        that no step pays for set-up. Called once, before any step."""

    @abstractmethod
    def execute_model(self, plan: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step and return without waiting for the device; the handle's ``get_output``
        waits for the step's sampled tokens. Every plan the scheduler emits comes here, empty ones
        included, in order (each carries the batch changes since the last, token values included:
        the workers learn nothing else from the engine), and handles are read in the order their
        plans were launched."""

    @abstractmethod
    def reset_batch(self) -> None:
        """Forget every request, after a failed step: the next plan starts from an empty batch, and
        the outputs of steps already launched are never read."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers and the device memory they hold; no other method is called afterwards."""
