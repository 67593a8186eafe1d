"""The tensor-parallel group of this process and its collectives (vLLM's ``parallel_state``).

Each worker process is one rank. When its worker starts it joins the world
(``init_distributed_environment``) and builds the tensor-parallel group (``initialize_model_parallel``);
the parallel layers bind ``get_tp_group()`` once, when they are built, and call its collectives in
their forward. The group holds two torch.distributed process groups over the same ranks: the device
group (NCCL on CUDA, gloo on CPU) for activations, and a gloo group on the CPU for control values (the
KV cache's block count), which never wait behind the device's queue.

Until a worker sets its own, every process has the one-rank group: no process group at all, and
collectives that return their input. The in-process executor, and models built directly (tests), run
on it at no cost. A worker of the multiprocess executor joins a world even when it is the only rank
(NCCL on CUDA, as vLLM does), so one device runs the same start-up as several; its collectives
still return their input, so its steps run nothing that one rank does not need.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GroupCoordinator:
    """The ranks of one parallel group, seen from one of them (vLLM's name): ``rank_in_group`` of
    ``world_size``, and thin wrappers over torch.distributed's collectives on the group."""

    def __init__(self, ranks: list[int], rank: int, device_backend: str | None = None) -> None:
        self.ranks = list(ranks)
        self.rank = rank  # in the world
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.device_group = self.cpu_group = None
        if dist.is_initialized():  # every rank creates both groups, in the same order
            self.device_group = dist.new_group(self.ranks, backend=device_backend)
            self.cpu_group = dist.new_group(self.ranks, backend="gloo")

    def warm_up(self, device: torch.device) -> None:
        """One all-reduce on the device group, whatever the number of ranks: NCCL creates a
        group's communicator at its first collective, which must come before a CUDA graph captures
        one (creating it inside a capture fails)."""
        if self.device_group is not None:
            dist.all_reduce(torch.zeros(1, device=device), group=self.device_group)

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of ``input_`` over the ranks, written into ``input_`` and returned."""
        if self.world_size > 1:
            dist.all_reduce(input_, group=self.device_group)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` (all of one shape), concatenated along ``dim`` in rank order, on
        every rank."""
        if self.world_size == 1:
            return input_
        dim %= input_.dim()
        # The ranks' tensors one after the other along the first dimension (the form gloo takes too).
        gathered = torch.empty((self.world_size * input_.shape[0], *input_.shape[1:]), dtype=input_.dtype,
                               device=input_.device)
        _all_gather_into_tensor(gathered, input_.contiguous(), group=self.device_group)
        if dim == 0:
            return gathered
        shape = list(input_.shape)
        shape[dim] *= self.world_size
        return gathered.view(self.world_size, *input_.shape).movedim(0, dim).reshape(shape)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``input_`` concatenated along ``dim`` on rank ``dst`` of the group; None on the others."""
        if self.world_size == 1:
            return input_
        pieces = [torch.empty_like(input_) for _ in self.ranks] if self.rank_in_group == dst else None
        dist.gather(input_.contiguous(), pieces, dst=self.ranks[dst], group=self.device_group)
        return None if pieces is None else torch.cat(pieces, dim)

    def all_reduce_min(self, value: int) -> int:
        """The smallest of the ranks' ``value``, over the CPU group."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())

    def destroy(self) -> None:
        for group in (self.device_group, self.cpu_group):
            if group is not None:
                dist.destroy_process_group(group)
        self.device_group = self.cpu_group = None


_SINGLE_RANK = GroupCoordinator([0], 0)
_TP: GroupCoordinator = _SINGLE_RANK


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group (the one-rank group unless its worker set another)."""
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str | None,
                                 backend: str) -> None:
    """Join the world of ``world_size`` processes (one included) as ``rank``, meeting the others at
    ``distributed_init_method`` (a ``tcp://host:port`` store)."""
    if dist.is_initialized():
        raise RuntimeError("this process has already joined a process group")
    dist.init_process_group(backend, init_method=distributed_init_method, world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_model_parallel_size: int, backend: str) -> None:
    """Set this process's tensor-parallel group, once: every rank of the world (tensor parallelism
    is the only kind here), its activations over ``backend``."""
    global _TP
    if _TP is not _SINGLE_RANK:
        raise RuntimeError("the tensor parallel group of this process is already set")
    if not dist.is_initialized() or dist.get_world_size() != tensor_model_parallel_size:
        world = dist.get_world_size() if dist.is_initialized() else None
        raise RuntimeError(f"tensor_parallel_size={tensor_model_parallel_size} needs a world of as many "
                           f"processes (init_distributed_environment); this process's world is {world}")
    _TP = GroupCoordinator(list(range(tensor_model_parallel_size)), dist.get_rank(), backend)


def destroy_model_parallel() -> None:
    """Release the tensor-parallel group; the process is back on the one-rank group."""
    global _TP
    _TP.destroy()
    _TP = _SINGLE_RANK


def destroy_distributed_environment() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
