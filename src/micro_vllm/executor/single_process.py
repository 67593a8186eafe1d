"""The Executor of one device: each call goes straight to one Worker in this process."""

from __future__ import annotations

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.config import LLMConfig
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.executor.abstract import Executor
from micro_vllm.outputs import AsyncModelRunnerOutput
from micro_vllm.worker.worker import Worker


class SingleProcessExecutor(Executor):
    def __init__(self, config: LLMConfig, model_path, hf_config, max_model_len: int) -> None:
        self.worker = Worker(config, model_path, hf_config, max_model_len)

    def get_attention_specs(self) -> list[AttentionSpec]:
        return self.worker.model_runner.get_attention_specs()

    def determine_num_blocks(self, max_blocks_per_request: int) -> int:
        return self.worker.determine_num_blocks(max_blocks_per_request)

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self.worker.initialize_kv_cache(groups, num_blocks)

    def execute_model(self, plan: SchedulerOutput) -> AsyncModelRunnerOutput:
        return self.worker.execute_model(plan)

    def reset_batch(self) -> None:
        self.worker.reset_batch()

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.worker = None
