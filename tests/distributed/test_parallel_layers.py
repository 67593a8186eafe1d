"""Each tensor-parallel layer against the unsharded layer, in fp32 on CPU: on two gloo ranks and on
one (where it must be the plain layer), before and after the oneDNN layout of its weight.

The check functions run on every rank (``RankPool.run``): each rank builds its slice of the layer,
loads it from the whole checkpoint tensors through the parameters' ``weight_loader``, and compares
its output with what the unsharded layer gives for the rank's slice (or the whole output, where the
layer gathers or reduces)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from micro_vllm.distributed import get_tp_group
from micro_vllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    onednn_runs,
    process_weights_after_loading,
)
from micro_vllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

HIDDEN, HEAD_SIZE, NUM_HEADS, VOCAB = 16, 8, 4, 11  # 11 tokens: two ranks pad the vocabulary to 12


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def rank_slice(size: int) -> slice:
    """This rank's even share of ``size``."""
    group = get_tp_group()
    share = size // group.world_size
    return slice(group.rank_in_group * share, (group.rank_in_group + 1) * share)


def load(param: torch.Tensor, tensor: torch.Tensor | None, shard_id=None) -> None:
    if tensor is not None:
        param.weight_loader(param, tensor, shard_id)


def check_forward(layer: torch.nn.Module, input_size: int, case) -> None:
    """``case(x)`` gives the layer's input for a whole input ``x`` of ``input_size`` features and the
    output it must give; checked for one row and several, then again with the weight laid out for
    oneDNN where that runs."""
    for layout in ("plain", "onednn"):
        if layout == "onednn":
            if not onednn_runs(layer.weight):
                return
            process_weights_after_loading(layer)
            assert layer.weight.is_mkldnn
        for rows in (1, 5):
            layer_input, expected = case(random(rows, input_size, seed=rows))
            with torch.inference_mode():
                torch.testing.assert_close(layer(layer_input), expected, atol=1e-5, rtol=1e-5)


# -- the checks, run on every rank -------------------------------------------------------------


def check_column_parallel(bias: bool, gather_output: bool) -> None:
    weight, b = random(12, HIDDEN, seed=1), random(12, seed=2) if bias else None
    layer = ColumnParallelLinear(HIDDEN, 12, bias=bias, gather_output=gather_output)
    load(layer.weight, weight)
    load(layer.bias, b)
    assert layer.weight.shape == (12 // get_tp_group().world_size, HIDDEN)
    check_forward(layer, HIDDEN, lambda x: (x, F.linear(x, weight, b)[:, slice(None) if gather_output else rank_slice(12)]))


def check_row_parallel(bias: bool) -> None:
    weight, b = random(12, 2 * HIDDEN, seed=3), random(12, seed=4) if bias else None
    layer = RowParallelLinear(2 * HIDDEN, 12, bias=bias)
    load(layer.weight, weight)
    load(layer.bias, b)
    check_forward(layer, 2 * HIDDEN, lambda x: (x[:, rank_slice(2 * HIDDEN)], F.linear(x, weight, b)))


def check_merged_column_parallel(bias: bool) -> None:
    gate, up = random(20, HIDDEN, seed=5), random(20, HIDDEN, seed=6)
    gate_bias, up_bias = (random(20, seed=7), random(20, seed=8)) if bias else (None, None)
    layer = MergedColumnParallelLinear(HIDDEN, [20, 20], bias=bias)
    for index, (weight, b) in enumerate([(gate, gate_bias), (up, up_bias)]):
        load(layer.weight, weight, index)
        load(layer.bias, b, index)
    rows = rank_slice(20)
    check_forward(layer, HIDDEN, lambda x: (x, torch.cat([F.linear(x, gate, gate_bias)[:, rows],
                                                           F.linear(x, up, up_bias)[:, rows]], dim=-1)))


def check_qkv_parallel(num_kv_heads: int, bias: bool) -> None:
    group = get_tp_group()
    q, k, v = (random(heads * HEAD_SIZE, HIDDEN, seed=9 + i) for i, heads in enumerate([NUM_HEADS] + [num_kv_heads] * 2))
    biases = [random(w.shape[0], seed=12 + i) if bias else None for i, w in enumerate((q, k, v))]
    layer = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, num_kv_heads, bias=bias)
    for shard_id, weight, b in zip("qkv", (q, k, v), biases):
        load(layer.weight, weight, shard_id)
        load(layer.bias, b, shard_id)
    assert layer.num_heads == NUM_HEADS // group.world_size
    assert layer.num_kv_heads == max(1, num_kv_heads // group.world_size)
    # Fewer KV heads than ranks: rank r holds head r * num_kv_heads // world_size.
    first_kv_head = group.rank_in_group * num_kv_heads // group.world_size
    kv_rows = slice(first_kv_head * HEAD_SIZE, (first_kv_head + layer.num_kv_heads) * HEAD_SIZE)
    q_rows = rank_slice(NUM_HEADS * HEAD_SIZE)

    def case(x):
        outputs = [F.linear(x, w, b) for w, b in zip((q, k, v), biases)]
        return x, torch.cat([outputs[0][:, q_rows], outputs[1][:, kv_rows], outputs[2][:, kv_rows]], dim=-1)

    check_forward(layer, HIDDEN, case)


def edge_ids() -> torch.Tensor:
    """Token ids at both edges of every rank's rows, the first and the last of the vocabulary."""
    rows = -(-VOCAB // get_tp_group().world_size)
    edges = {0, VOCAB - 1} | {i for r in range(1, get_tp_group().world_size) for i in (r * rows - 1, r * rows)}
    return torch.tensor(sorted(edges) + [3, 0, VOCAB - 1])


def check_vocab_parallel_embedding() -> None:
    table = random(VOCAB, HIDDEN, seed=15)
    layer = VocabParallelEmbedding(VOCAB, HIDDEN)
    load(layer.weight, table)
    ids = edge_ids()
    assert torch.equal(layer(ids), F.embedding(ids, table))  # one rank's row plus zeros: exact


def check_parallel_lm_head(tied: bool) -> None:
    table = random(VOCAB, HIDDEN, seed=16)
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN) if tied else None
    head = ParallelLMHead(VOCAB, HIDDEN, tied_to=embedding)
    load((embedding or head).weight, table)
    if tied:
        assert head.weight is embedding.weight
    check_forward(head, HIDDEN, lambda x: (x, x @ table.T))
    if tied:  # the head's layout for oneDNN is its own copy: the embedding still reads the plain rows
        ids = edge_ids()
        assert torch.equal(embedding(ids), F.embedding(ids, table))


def check_collectives() -> None:
    group = get_tp_group()
    rank, n = group.rank_in_group, group.world_size
    pieces = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(n)]
    mine = pieces[rank]
    assert torch.equal(group.all_gather(mine, dim=-1), torch.cat(pieces, dim=-1))
    assert torch.equal(group.all_gather(mine, dim=0), torch.cat(pieces, dim=0))
    gathered = group.gather(mine, dst=0, dim=0)
    assert torch.equal(gathered, torch.cat(pieces, dim=0)) if rank == 0 else gathered is None
    assert torch.equal(group.all_reduce(mine.clone()), sum(pieces))
    assert group.all_reduce_min(7 + rank) == 7


def check_refusals() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
        QKVParallelLinear(HIDDEN, HEAD_SIZE, 3, 1)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 is not divisible by tensor_parallel_size=2"):
        QKVParallelLinear(HIDDEN, HEAD_SIZE, 6, 3)
    with pytest.raises(ValueError, match=r"output_sizes\[1\]=7 is not divisible by tensor_parallel_size=2"):
        MergedColumnParallelLinear(HIDDEN, [8, 7])
    with pytest.raises(ValueError, match=r"input_size=9 is not divisible by tensor_parallel_size=2"):
        RowParallelLinear(9, HIDDEN)
    layer = ColumnParallelLinear(HIDDEN, 12)
    with pytest.raises(ValueError, match=r"checkpoint shape \(13, 16\), expected \(12, 16\)"):
        load(layer.weight, random(13, HIDDEN, seed=0))
    with pytest.raises(ValueError, match=r"shard_id='q' is not one of this parameter's \[None\]"):
        load(layer.weight, random(12, HIDDEN, seed=0), "q")


# -- the tests: each check on two ranks and on one ---------------------------------------------

CHECKS = [
    pytest.param(check_column_parallel, (bias, gather), id=f"column-bias={bias}-gather={gather}")
    for bias in (False, True) for gather in (False, True)
] + [
    pytest.param(check_row_parallel, (bias,), id=f"row-bias={bias}") for bias in (False, True)
] + [
    pytest.param(check_merged_column_parallel, (bias,), id=f"merged-bias={bias}") for bias in (False, True)
] + [
    # 2 KV heads: one per rank (GQA); 1 KV head: fewer than the ranks, replicated.
    pytest.param(check_qkv_parallel, (kv, bias), id=f"qkv-kv_heads={kv}-bias={bias}")
    for kv in (2, 1) for bias in (False, True)
] + [
    pytest.param(check_vocab_parallel_embedding, (), id="vocab_embedding"),
    pytest.param(check_parallel_lm_head, (False,), id="lm_head"),
    pytest.param(check_parallel_lm_head, (True,), id="lm_head-tied"),
]


@pytest.mark.parametrize("check, args", CHECKS)
def test_layer_on_two_ranks_matches_the_unsharded_layer(rank_pool, check, args):
    rank_pool.run(check, *args)


@pytest.mark.parametrize("check, args", CHECKS)
def test_layer_on_one_rank_is_the_unsharded_layer(check, args):
    check(*args)


def test_collectives(rank_pool):
    rank_pool.run(check_collectives)
    check_collectives()  # one rank: each collective gives its input


def test_a_split_that_does_not_divide_is_refused_naming_both_numbers(rank_pool):
    rank_pool.run(check_refusals)
