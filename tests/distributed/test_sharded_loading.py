"""Each rank reads only its slices of the checkpoint: the parallel layers' ``weight_loader``s index
the safetensors slices that ``stream_weights`` hands them, and nothing else is read."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from micro_vllm.distributed import get_tp_group
from micro_vllm.layers.linear import QKVParallelLinear, RowParallelLinear
from micro_vllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from micro_vllm.model_loader.checkpoint import stream_weights

HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, VOCAB = 16, 4, 4, 2, 11
# checkpoint name -> (our layer, shard_id)
TARGETS = {"q_proj.weight": ("qkv_proj", "q"), "k_proj.weight": ("qkv_proj", "k"),
           "v_proj.weight": ("qkv_proj", "v"), "o_proj.weight": ("o_proj", None),
           "embed_tokens.weight": ("embed_tokens", None)}


def checkpoint() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"q_proj.weight": (NUM_HEADS * HEAD_SIZE, HIDDEN), "k_proj.weight": (NUM_KV_HEADS * HEAD_SIZE, HIDDEN),
              "v_proj.weight": (NUM_KV_HEADS * HEAD_SIZE, HIDDEN), "o_proj.weight": (HIDDEN, NUM_HEADS * HEAD_SIZE),
              "embed_tokens.weight": (VOCAB, HIDDEN)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


class RecordingSlice:
    """A safetensors slice that records the index of every read (as (start, stop) per dimension)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.reads: list[tuple[tuple[int | None, int | None], ...]] = []

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.reads.append(tuple((part.start, part.stop) for part in index))
        return self.inner[index]


def load_from_file(path) -> tuple[dict[str, list], dict[str, torch.Tensor]]:
    """On one rank: build the layers, load them from ``path`` through lazy slices; return what was
    read of each tensor and the parameters loaded."""
    layers = {"qkv_proj": QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, bias=False),
              "o_proj": RowParallelLinear(NUM_HEADS * HEAD_SIZE, HIDDEN, bias=False),
              "embed_tokens": VocabParallelEmbedding(VOCAB, HIDDEN)}
    reads = {}
    for name, lazy in stream_weights([path], {}):
        layer, shard_id = TARGETS[name]
        recording = RecordingSlice(lazy)
        param = layers[layer].weight
        param.weight_loader(param, recording, shard_id)
        reads[name] = recording.reads
    return reads, {name: layer.weight.detach().clone() for name, layer in layers.items()}


def test_each_rank_reads_only_its_rows(rank_pool, tmp_path):
    tensors = checkpoint()
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    results = rank_pool.run(load_from_file, path)
    for rank, (reads, params) in enumerate(results):
        q_rows = (rank * 8, rank * 8 + 8)  # 2 of 4 query heads of 4 rows each
        kv_rows = (rank * 4, rank * 4 + 4)  # 1 of 2 KV heads
        vocab_rows = (rank * 6, rank * 6 + 6)  # 11 tokens padded to 12: 6 each, the last rank's 11th is padding
        assert reads == {
            "q_proj.weight": [(q_rows,)],
            "k_proj.weight": [(kv_rows,)],
            "v_proj.weight": [(kv_rows,)],
            "o_proj.weight": [((None, None), (rank * 8, rank * 8 + 8))],  # its input columns
            "embed_tokens.weight": [(vocab_rows,)],
        }
        expected_qkv = torch.cat([tensors["q_proj.weight"][slice(*q_rows)], tensors["k_proj.weight"][slice(*kv_rows)],
                                  tensors["v_proj.weight"][slice(*kv_rows)]])
        assert torch.equal(params["qkv_proj"], expected_qkv)
        assert torch.equal(params["o_proj"], tensors["o_proj.weight"][:, rank * 8: rank * 8 + 8])
        rows = tensors["embed_tokens.weight"][slice(*vocab_rows)]
        assert torch.equal(params["embed_tokens"][: len(rows)], rows)
        assert not params["embed_tokens"][len(rows):].any()  # the padding row stays zero


def test_one_rank_reads_every_tensor_whole(tmp_path):
    tensors = checkpoint()
    save_file(tensors, tmp_path / "model.safetensors")
    reads, params = load_from_file(tmp_path / "model.safetensors")
    assert get_tp_group().world_size == 1
    assert reads == {"q_proj.weight": [((0, 16),)], "k_proj.weight": [((0, 8),)], "v_proj.weight": [((0, 8),)],
                     "o_proj.weight": [((None, None), (0, 16))], "embed_tokens.weight": [((0, 11),)]}
    assert torch.equal(params["o_proj"], tensors["o_proj.weight"])
    assert torch.equal(params["embed_tokens"], tensors["embed_tokens.weight"])
    assert torch.equal(params["qkv_proj"], torch.cat([tensors[f"{p}_proj.weight"] for p in "qkv"]))
