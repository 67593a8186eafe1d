"""The linear layers of tensor parallelism (vLLM's names), and their CPU path through oneDNN.

Each rank holds a slice of every projection. ``ColumnParallelLinear`` splits the outputs
(``MergedColumnParallelLinear`` each of several projections that read the same input, gate/up;
``QKVParallelLinear`` the heads), so a rank computes its own heads or its own part of the MLP's hidden
features; ``RowParallelLinear`` splits the inputs, each rank multiplies its slice, and an all-reduce
sums the partial outputs (after ``o_proj`` and ``down_proj``). The checkpoint keeps q/k/v and gate/up
as separate tensors; each parameter's ``weight_loader`` copies in the rank's slice of each, in its
rows. With one rank every layer is the plain matmul and no collective runs.

On CPU, fp32 matmuls at decode's small batches run faster from a weight oneDNN has laid out for them
once than through ``F.linear``'s BLAS call on the plain weight, so ``process_weights_after_loading``
(vLLM's name) swaps each layer's weight for that layout after the checkpoint is in: the layers share
the base ``LinearBase``, which holds that path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from micro_vllm.distributed import GroupCoordinator, divide, get_tp_group, num_kv_heads_per_rank
from micro_vllm.model_loader.weight_utils import Shard, ShardedWeightLoader, ShardId, default_weight_loader


class LinearBase(nn.Linear):
    """``nn.Linear`` whose matmul runs through oneDNN once ``use_onednn`` has repacked its weight: the
    base of every linear layer here, each holding its rank's shape.

    A single row (one decode) is a matrix-vector product bound by reading the weight; BLAS streams
    the transposed weight, [in, out], faster than either oneDNN's layout or the plain one, so the
    layer keeps that copy too (on CPU it holds its weight twice)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("transposed_weight", None, persistent=False)  # set by use_onednn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` through the weight's layout (``bias`` None: none added)."""
        if not self.weight.is_mkldnn:
            return F.linear(x, self.weight, bias)
        if x.shape[0] == 1:
            if bias is None:
                return torch.mm(x, self.transposed_weight)
            return torch.addmm(bias, x, self.transposed_weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")

    @torch.no_grad()
    def use_onednn(self) -> None:
        """Replace the plain weight by oneDNN's layout of it and its transpose (the plain one is freed
        unless shared)."""
        self.transposed_weight = self.weight.t().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        self.weight = nn.Parameter(packed, requires_grad=False)


def onednn_runs(weight: torch.Tensor) -> bool:
    """Whether oneDNN serves ``weight``'s matmuls: fp32 on a CPU build that has it (it would emulate
    bf16 on CPUs without bf16 instructions)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def process_weights_after_loading(model: nn.Module) -> None:
    """Lay out every linear layer's weight for oneDNN where it runs; a no-op on GPUs."""
    for module in model.modules():
        if isinstance(module, LinearBase) and onednn_runs(module.weight):
            module.use_onednn()


class ColumnParallelLinear(LinearBase):
    """A linear layer whose output features are split evenly over the tensor-parallel ranks: rank r
    computes features ``r * n / N ..`` of the ``n``. ``gather_output`` all-gathers the whole output
    onto every rank; without it each rank keeps its slice, for a ``RowParallelLinear`` or for
    attention over the rank's heads."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False) -> None:
        tp_group = get_tp_group()
        self._build(input_size, _split_evenly({None: output_size}, tp_group, "output_size"), bias, tp_group)
        self.gather_output = gather_output

    def _build(self, input_size: int, pieces: list[tuple[ShardId, int, int, int]], bias: bool,
               tp_group: GroupCoordinator) -> None:
        """Build the rank's layer from its ``pieces``, stacked in order along the outputs: for each
        checkpoint tensor that fills it, ``(shard_id, its rows, the first row this rank takes, rows taken)``."""
        super().__init__(input_size, sum(rows for *_, rows in pieces), bias=bias)
        self.tp_group = tp_group
        self.gather_output = False  # ColumnParallelLinear's own choice; a fused layer's slices never gather
        shards, offset = {}, 0
        for shard_id, total, start, rows in pieces:
            shards[shard_id] = Shard(offset, start, rows, total)
            offset += rows
        loader = ShardedWeightLoader(0, shards)  # a bias splits along its one dimension as the weight's rows do
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.matmul(x, self.bias)
        return self.tp_group.all_gather(output) if self.gather_output else output


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input run as one matmul (gate/up): each rank holds
    its slice of each, stacked in order; ``weight_loader``'s shard_id is the projection's index."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True) -> None:
        tp_group = get_tp_group()
        sizes = dict(enumerate(output_sizes))
        self._build(input_size, _split_evenly(sizes, tp_group, "output_sizes"), bias, tp_group)


class QKVParallelLinear(ColumnParallelLinear):
    """The q/k/v projections as one column-parallel matmul, split by heads: each rank holds
    ``num_heads`` query heads and ``num_kv_heads`` key/value heads (shard_id "q", "k", "v").

    With fewer KV heads than ranks each KV head is replicated over ``tp_size / total_num_kv_heads``
    ranks: rank r holds KV head ``r * total_num_kv_heads // tp_size``."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = True) -> None:
        tp_group = get_tp_group()
        tp_size, rank = tp_group.world_size, tp_group.rank_in_group
        num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        num_kv_heads = num_kv_heads_per_rank(total_num_kv_heads, tp_size)
        q_size, kv_size, kv_total = num_heads * head_size, num_kv_heads * head_size, total_num_kv_heads * head_size
        kv_start = rank * total_num_kv_heads // tp_size * head_size
        pieces = [("q", total_num_heads * head_size, rank * q_size, q_size),
                  ("k", kv_total, kv_start, kv_size), ("v", kv_total, kv_start, kv_size)]
        self._build(hidden_size, pieces, bias, tp_group)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.q_size, self.kv_size = q_size, kv_size  # this rank's


class RowParallelLinear(LinearBase):
    """A linear layer whose input features are split evenly over the ranks: each rank takes its slice
    of the input (the output of a column-parallel layer) and the partial outputs are summed by an
    all-reduce, so every rank holds the whole output. The bias, whole on every rank, joins rank 0's
    partial sum, so the all-reduce adds it exactly once (and one rank is a plain linear layer)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        tp_group = get_tp_group()
        [(_, total, start, columns)] = _split_evenly({None: input_size}, tp_group, "input_size")
        super().__init__(columns, output_size, bias=bias)
        self.tp_group = tp_group
        self.weight.weight_loader = ShardedWeightLoader(1, {None: Shard(0, start, columns, total)})
        if bias:
            self.bias.weight_loader = default_weight_loader
        self.adds_bias = tp_group.rank_in_group == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_group.all_reduce(self.matmul(x, self.bias if self.adds_bias else None))


def _split_evenly(sizes: dict[ShardId, int], tp_group: GroupCoordinator,
                  name: str) -> list[tuple[ShardId, int, int, int]]:
    """``ColumnParallelLinear._build``'s pieces for sizes split evenly over the ranks; ``name`` names
    the sizes in the error for one that does not split."""
    pieces = []
    for shard_id, size in sizes.items():
        rows = divide(size, tp_group.world_size, name if shard_id is None else f"{name}[{shard_id}]")
        pieces.append((shard_id, size, tp_group.rank_in_group * rows, rows))
    return pieces
