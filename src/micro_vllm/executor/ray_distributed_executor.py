"""The Executor of ranks placed by Ray (vLLM's ``RayDistributedExecutor``): one Ray actor per rank,
each holding the rank's ``Worker``, on one node or several.

Start-up: the executor uses the Ray instance this process is connected to, or joins a running
cluster (``ray.init(address="auto")``), or else starts a local Ray instance, which its ``shutdown``
stops. It reserves one placement-group bundle per rank (``{"GPU": 1, "CPU": 1}`` on CUDA,
``{"CPU": 1}`` on CPU): ``STRICT_PACK`` when one node can hold them all, else ``PACK`` (the fewest
nodes; what vLLM asks for), and starts an actor in each bundle. Ranks follow the nodes: the driver's
node first, then by node address. Each actor builds its rank's ``Worker``, which joins the others
through a TCP store that rank 0 serves: on 127.0.0.1 when all ranks share a node, else at rank 0's
node address; on port ``MICRO_VLLM_PORT`` when set (to open in a firewall), else one free on rank 0's
node. On CUDA each rank sees its ranks' GPUs in rank order, so that cuda:r (the Worker's choice) is the
GPU Ray gave it; ranks on CUDA must share one node until the Worker takes a local rank. If any rank
fails to start, its error is raised here and every actor and the placement group are removed.

A step: ``execute_model`` pickles the plan once and hands the bytes by value to every actor's
``execute_model`` (a small argument travels inside the call; ``ray.put`` goes through the object
store, which measured slower), and returns a handle on the calls' ObjectRefs. An actor runs its calls
in order: the next step's call waits in its queue while this step runs, so one step stays in flight
while the engine plans the next. (Unlike a multiprocess worker, an actor waits for a step's tokens
before it starts preparing the next, as vLLM's Ray workers do.) Each rank returns once its tokens are
on the host, rank 0 with the ``ModelRunnerOutput``; the handle's ``get_output`` is the step's one
``ray.get``, over every rank's ObjectRef, so that a rank that failed is seen at once, even while the
others wait for it in a collective. Plain actor calls, not Ray's compiled graphs, whose actors poll
their channels, half a core each while idle (docs/distributed.md has the figures).

Faults: an actor that raises, dies or loses its node fails that ``ray.get``: every actor and the
placement group are removed, and the waiting call and every later one raise ``EngineDeadError``
with Ray's error as the cause. The actors and the placement group belong to the process that made
them: Ray removes them when it exits, however it ends.
"""

from __future__ import annotations

import logging
import os
import pickle
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from micro_vllm.attention.spec import AttentionSpec
from micro_vllm.config import LLMConfig
from micro_vllm.core.kv_cache_manager import KVCacheGroup
from micro_vllm.core.scheduler_output import SchedulerOutput
from micro_vllm.distributed import get_open_port
from micro_vllm.engine.exceptions import EngineDeadError
from micro_vllm.executor.abstract import Executor
from micro_vllm.executor.multiproc_executor import dumps
from micro_vllm.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from micro_vllm.utils import freeze_start_up_heap, sigint_held_back
from micro_vllm.worker.worker import Worker

logger = logging.getLogger(__name__)

# The torch.distributed store's port, for clusters whose nodes only talk through opened ports.
PORT_ENV = "MICRO_VLLM_PORT"
# How long start-up waits for the cluster to free the bundles it holds but lends to others.
PLACEMENT_TIMEOUT_S = 300


class ActorPlace(NamedTuple):
    """Where an actor runs: its node's address, the GPU ids Ray gave it there, its process id."""

    node_ip: str
    gpu_ids: list[str]
    pid: int


class RayWorkerWrapper:
    """One rank inside a Ray actor (vLLM's name): where the actor runs, then the rank's Worker."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.rank = -1

    def get_place(self) -> ActorPlace:
        gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return ActorPlace(ray.util.get_node_ip_address(), [str(gpu) for gpu in gpu_ids], os.getpid())

    def get_open_port(self) -> int:
        return get_open_port()

    def init_worker(self, config: LLMConfig, model_path, hf_config, max_model_len: int, rank: int,
                    distributed_init_method: str, env: dict[str, str]) -> None:
        os.environ.update(env)  # before the Worker touches CUDA
        self.rank = rank
        self.worker = Worker(config, model_path, hf_config, max_model_len, rank, distributed_init_method)

    def execute_model(self, plan_bytes: bytes) -> ModelRunnerOutput | None:
        # Every rank fetches its step's output, so that every runner sees the same calls.
        output = self.worker.execute_model(pickle.loads(plan_bytes)).get_output()
        return output if self.rank == 0 else None

    def get_attention_specs(self) -> list[AttentionSpec]:
        return self.worker.model_runner.get_attention_specs()

    def determine_num_blocks(self, max_blocks_per_request: int) -> int:
        return self.worker.determine_num_blocks(max_blocks_per_request)

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self.worker.initialize_kv_cache(groups, num_blocks)
        freeze_start_up_heap()  # the last call of start-up: the steps come next

    def reset_batch(self) -> None:
        self.worker.reset_batch()


@dataclass
class RayWorkerHandle:
    """One rank's actor, as the executor holds it."""

    rank: int
    actor: Any  # ray.actor.ActorHandle
    place: ActorPlace


@dataclass
class RayHoldings:
    """What an executor holds in Ray, all of which its removal gives back."""

    owns_ray: bool  # it started the local Ray instance
    group: PlacementGroup | None = None
    workers: list[RayWorkerHandle] = field(default_factory=list)


class RayStepOutput(AsyncModelRunnerOutput):
    """A launched step; ``get_output`` waits for every rank's call and returns rank 0's output."""

    def __init__(self, executor: RayDistributedExecutor, refs: list[ray.ObjectRef]) -> None:
        self.executor = executor
        self.refs = refs

    def get_output(self) -> ModelRunnerOutput:
        return self.executor.wait_for_step(self)


class RayDistributedExecutor(Executor):
    def __init__(self, config: LLMConfig, model_path, hf_config, max_model_len: int) -> None:
        holdings = RayHoldings(owns_ray=_connect_to_ray())
        self.workers = holdings.workers  # in rank order
        self._finalizer = weakref.finalize(self, _remove, holdings)
        self._started = False
        self._dead: BaseException | None = None  # the error that stopped the actors
        self._unread: list[RayStepOutput] = []  # steps launched whose output was not read
        try:
            bundles = _bundles(config, config.parallel_config.world_size)
            strategy = _placement_strategy(bundles)
            holdings.group = placement_group(bundles, strategy=strategy)
            _wait_until_placed(holdings.group, strategy)
            self.workers += _start_actors(holdings.group, bundles)
            address, envs = self._rendezvous(config)
            self._get([w.actor.init_worker.remote(config, model_path, hf_config, max_model_len, w.rank, address,
                                                  envs[w.rank]) for w in self.workers])
        except BaseException:
            self._finalizer()
            raise
        self._started = True

    # -- the Executor interface

    def get_attention_specs(self) -> list[AttentionSpec]:
        return self._call("get_attention_specs")

    def determine_num_blocks(self, max_blocks_per_request: int) -> int:
        return self._call("determine_num_blocks", max_blocks_per_request)  # the same on every rank (a MIN all-reduce)

    def initialize_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self._call("initialize_kv_cache", groups, num_blocks)

    def execute_model(self, plan: SchedulerOutput) -> AsyncModelRunnerOutput:
        self._check_alive()
        plan_bytes = dumps(plan)
        # To every rank or none: a Ctrl-C between two calls would leave the ranks that got the step
        # waiting in its collectives for one that never runs it, and the rollback waiting for them.
        with sigint_held_back():
            refs = [w.actor.execute_model.remote(plan_bytes) for w in self.workers]
        step = RayStepOutput(self, refs)
        self._unread.append(step)
        return step

    def reset_batch(self) -> None:
        if self._dead is None:  # after a failure nothing runs, and the engine's rollback goes on without
            # The dropped steps too: a rank that failed in one would leave the others in a collective.
            dropped = [ref for step in self._unread for ref in step.refs]
            self._unread.clear()
            self._get(dropped + [w.actor.reset_batch.remote() for w in self.workers])

    def shutdown(self) -> None:
        self._finalizer()
        self._dead = self._dead or RuntimeError("the executor was shut down")

    # -- calls

    def wait_for_step(self, step: RayStepOutput) -> ModelRunnerOutput:
        self._check_alive()
        self._unread.remove(step)
        return self._get(step.refs)[0]

    def _call(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every rank's actor; rank 0's result."""
        self._check_alive()
        return self._get([getattr(w.actor, method).remote(*args) for w in self.workers])[0]

    def _get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """The results of ``refs`` (one ``ray.get``, which raises at the first that failed). A
        failure removes every actor; after start-up it fails the engine with EngineDeadError."""
        try:
            return ray.get(refs)
        except RayError as error:
            self._finalizer()  # the other ranks may wait in a collective for the one that failed
            if not self._started:
                raise  # the rank's own error reaches the caller of the constructor
            self._dead = error
            raise self._dead_error() from error

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        # The first line of Ray's message says what happened ("The actor died unexpectedly ...").
        reason = next((line for line in str(self._dead).splitlines() if line.strip()), "")
        dead = EngineDeadError(f"the engine's workers stopped: {type(self._dead).__name__}: {reason}")
        dead.__cause__ = self._dead
        return dead

    def _rendezvous(self, config: LLMConfig) -> tuple[str, list[dict[str, str]]]:
        """Where the ranks meet (``tcp://host:port``), and each rank's environment: on CUDA every rank
        sees the ranks' GPUs in rank order, so that cuda:r is the GPU Ray gave rank r."""
        rank0 = self.workers[0]
        nodes = sorted({w.place.node_ip for w in self.workers})
        host = "127.0.0.1" if len(nodes) == 1 else rank0.place.node_ip  # rank 0 serves the store
        port = int(os.environ.get(PORT_ENV) or self._get([rank0.actor.get_open_port.remote()])[0])
        logger.info("Ray executor: %d ranks on nodes %s meet at %s:%d", len(self.workers), nodes, host, port)
        if not rank0.place.gpu_ids:
            return f"tcp://{host}:{port}", [{} for _ in self.workers]
        if len(nodes) > 1:
            raise ValueError(f"tensor_parallel_size={len(self.workers)} on CUDA across nodes {nodes}: each rank's "
                             "Worker takes cuda:<rank>, which on a second node is not its GPU; give the ranks one node")
        gpus = ",".join(w.place.gpu_ids[0] for w in self.workers)
        return f"tcp://{host}:{port}", [{"CUDA_VISIBLE_DEVICES": gpus} for _ in self.workers]


# -- start-up and removal ----------------------------------------------------------------------


def _connect_to_ray() -> bool:
    """Connect this process to Ray; whether it started the instance (and so stops it)."""
    if ray.is_initialized():
        logger.info("Ray executor: using the Ray instance this process is connected to")
        return False
    try:
        ray.init(address="auto")  # RAY_ADDRESS's cluster when set, else the one started on this node
        logger.info("Ray executor: joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)
        return False
    except ConnectionError:
        if os.environ.get("RAY_ADDRESS"):
            raise  # the cluster asked for is not there: not a reason to start another
    ray.init(address="local")
    logger.info("Ray executor: no Ray cluster is running; started a local Ray instance")
    return True


def _bundles(config: LLMConfig, world_size: int) -> list[dict[str, float]]:
    """One bundle per rank: a GPU and a CPU on CUDA, a CPU on CPU ("auto": CUDA if the cluster has GPUs)."""
    device = config.model_config.device
    use_gpu = device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return [{"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0} for _ in range(world_size)]


def _placement_strategy(bundles: list[dict[str, float]]) -> str:
    """STRICT_PACK when one node of the cluster has room for every bundle, else PACK (the fewest
    nodes). Raises at once when the whole cluster has too few of a resource."""
    needed = {key: sum(bundle[key] for bundle in bundles) for key in bundles[0]}
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    for key, amount in needed.items():
        total = sum(node.get(key, 0) for node in nodes)
        if total < amount:
            raise ValueError(f"tensor_parallel_size={len(bundles)} needs {amount:g} {key} in the Ray cluster, one "
                             f"per rank; its {len(nodes)} node(s) have {total:g}")
    if any(all(node.get(key, 0) >= amount for key, amount in needed.items()) for node in nodes):
        return "STRICT_PACK"
    return "PACK"


def _wait_until_placed(group: PlacementGroup, strategy: str) -> None:
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        raise RuntimeError(f"the Ray cluster has not freed the bundles {group.bundle_specs} ({strategy}) in "
                           f"{PLACEMENT_TIMEOUT_S} s: see `ray status`") from None


def _start_actors(group: PlacementGroup, bundles: list[dict[str, float]]) -> list[RayWorkerHandle]:
    """One actor in each bundle, ranked: the driver's node first, then by node address."""
    actor_cls = ray.remote(RayWorkerWrapper)
    actors = [actor_cls.options(
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
    ).remote() for index, bundle in enumerate(bundles)]
    try:
        places = ray.get([actor.get_place.remote() for actor in actors])
    except RayError:
        for actor in actors:
            ray.kill(actor)
        raise
    driver_ip = ray.util.get_node_ip_address()
    order = sorted(range(len(actors)), key=lambda i: (places[i].node_ip != driver_ip, places[i].node_ip, i))
    return [RayWorkerHandle(rank, actors[i], places[i]) for rank, i in enumerate(order)]


def _remove(holdings: RayHoldings) -> None:
    """Kill every actor (a rank waiting in a collective for a dead one never returns), remove the
    placement group, and stop the local Ray instance the executor started."""
    if not ray.is_initialized():
        return  # Ray's own exit hook ran first: what this process owned went with its connection
    for worker in holdings.workers:
        ray.kill(worker.actor)
    if holdings.group is not None:
        remove_placement_group(holdings.group)
    if holdings.owns_ray:
        ray.shutdown()
