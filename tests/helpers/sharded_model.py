"""What each rank does in the tensor-parallel model tests (test_tensor_parallel_model.py), in a module
of its own so that the ranks' processes import no more than this (no transformers models): load a
tiny model's slices, check them against the checkpoint, and decode greedily over paged attention."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.paged_run import PagedRun, bind_backend
from micro_vllm.distributed import get_tp_group
from micro_vllm.model_loader.checkpoint import load_hf_config, load_model
from micro_vllm.models.utils import head_size_of, num_kv_heads_of

PROMPT_LENGTHS, SPLITS, DECODE_STEPS = (7, 13, 17), (3, 9, 16), 6


def load_and_decode(path: Path, custom_ops: frozenset[str]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Load the model (this rank's slices), check them against the checkpoint, and decode greedily:
    each request's tokens and each step's logits."""
    if custom_ops and os.environ.get("TRITON_INTERPRET") == "1":
        from helpers.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()  # as conftest.py does in the test process
    hf_config = load_hf_config(path)
    model = bind_backend(load_model(path, hf_config, torch.float32, torch.device("cpu"), custom_ops), "sdpa")
    check_slices(model, hf_config, load_file(path / "model.safetensors"))
    return greedy(model)


def check_slices(model: torch.nn.Module, hf_config, checkpoint: dict[str, torch.Tensor]) -> None:
    group = get_tp_group()
    rank, tp = group.rank_in_group, group.world_size
    head_size, kv_heads = head_size_of(hf_config), num_kv_heads_of(hf_config)
    q_rows = hf_config.num_attention_heads // tp * head_size
    kv_rows = max(1, kv_heads // tp) * head_size
    kv_start = rank * kv_heads // tp * head_size  # fewer KV heads than ranks: each one on several ranks
    mlp_rows = hf_config.intermediate_size // tp
    vocab_rows = -(-hf_config.vocab_size // tp)

    def rows(name: str, start: int, count: int) -> torch.Tensor:
        return checkpoint[name][start : start + count]

    for name, param in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        parent, _, module = prefix.rpartition(".")
        if module == "qkv_proj":
            expected = torch.cat([rows(f"{parent}.q_proj.{leaf}", rank * q_rows, q_rows),
                                  rows(f"{parent}.k_proj.{leaf}", kv_start, kv_rows),
                                  rows(f"{parent}.v_proj.{leaf}", kv_start, kv_rows)])
        elif module == "gate_up_proj":
            expected = torch.cat([rows(f"{parent}.{piece}.{leaf}", rank * mlp_rows, mlp_rows)
                                  for piece in ("gate_proj", "up_proj")])
        elif module in ("o_proj", "down_proj") and leaf == "weight":
            columns = checkpoint[name].shape[1] // tp
            expected = checkpoint[name][:, rank * columns : (rank + 1) * columns]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            # A tied head's weight is the embedding's (on CPU, oneDNN's copy of it).
            source = "model.embed_tokens.weight" if hf_config.tie_word_embeddings else name
            expected = torch.zeros(vocab_rows, hf_config.hidden_size)  # the padding rows stay zero
            mine = rows(source, rank * vocab_rows, vocab_rows)
            expected[: len(mine)] = mine
        else:  # norms, the row-parallel layers' biases: whole on every rank
            expected = checkpoint[name]
        weight = param.to_dense() if param.is_mkldnn else param
        assert torch.equal(weight, expected), name


def greedy(model: torch.nn.Module) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill in two chunks (the second attends to the first's cached K/V), then decode greedily."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    run = PagedRun(model, len(prompts), block_size=4, seed=1)
    run.step([p[:s] for p, s in zip(prompts, SPLITS)])
    chunks = [p[s:] for p, s in zip(prompts, SPLITS)]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits = []
    for _ in range(DECODE_STEPS):
        last = torch.stack([step_logits[-1] for step_logits in run.step(chunks)])
        logits.append(last)
        chunks = [[int(token)] for token in last.argmax(dim=-1)]
        for output, [token] in zip(tokens, chunks):
            output.append(token)
    return tokens, logits
