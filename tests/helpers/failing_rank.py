"""A model config with which one rank of several fails to start (in its own module: the worker
processes import it to unpickle the config, and the rank pool's processes need not)."""

from __future__ import annotations

import torch.distributed as dist
from transformers import LlamaConfig


class LlamaConfigFailingOnRank1(LlamaConfig):
    """A Llama config whose model cannot be built on rank 1 of a process group: reading its layer
    count there raises, after the ranks have met. Everywhere else it is the config it was made from."""

    def __getattribute__(self, name: str):
        if name == "num_hidden_layers" and dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("injected: rank 1 cannot build its model")
        return super().__getattribute__(name)
