"""The device mesh of the data-parallel ranks: 1-D for FSDP, 2-D (replicate × shard) for HSDP.

``--replicate-groups R`` splits the W ranks into R groups of W/R consecutive ranks (normally one
group per node, so sharding's all-gathers and reduce-scatters stay on the node's fast links); each
group shards the model, and the groups hold replicas whose gradients are all-reduced across them.
Mesh dimension 0 is "replicate", 1 is "shard": the order FSDP2 and FSDP1's HYBRID_SHARD expect.
A 2-D mesh has no single process group (``mesh.get_group()`` raises): what needs the ranks that
share one model copy asks for ``shard_mesh(mesh)``.

Context parallelism (``--context-parallel N``) adds groups of N consecutive ranks (so within a node
first: a node's local ranks are consecutive), which share their micro-batches and cut each sequence
among them (``context_group``). It changes nothing in the mesh FSDP shards over: the weights stay
sharded over every rank (dp × cp flattened, as torchtitan does), and FSDP's reduction of the
gradients over all of them is what adds up the pieces' contributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtune.config import ConfigError, groups_refusal
from shardtune.runtime.distributed import Worker

REPLICATE, SHARD = "replicate", "shard"


def data_parallel_mesh(worker: Worker, replicate_groups: int = 1) -> DeviceMesh:
    refused = groups_refusal(replicate_groups, worker.world_size)  # the rule the run plan passed
    if refused:
        raise ConfigError(refused)
    if replicate_groups == 1:
        return init_device_mesh(worker.device.type, (worker.world_size,), mesh_dim_names=(SHARD,))
    return init_device_mesh(worker.device.type, (replicate_groups, worker.world_size // replicate_groups),
                            mesh_dim_names=(REPLICATE, SHARD))


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of the ranks that together hold one copy of the model (this rank's shard group)."""
    return mesh[SHARD] if mesh.ndim > 1 else mesh


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in data parallelism × context parallelism (``--context-parallel size``)."""

    size: int  # ranks per CP group: the pieces of each sequence
    rank: int  # this rank's piece
    group: dist.ProcessGroup | None  # the CP group (None when size is 1)
    data_rank: int  # this rank's data-parallel group: which share of the global batch it takes
    data_ranks: int  # data-parallel groups: the world size / size


def context_group(worker: Worker, size: int) -> ContextGroup:
    """The CP group of ``size`` consecutive ranks this rank belongs to (a collective: every rank calls it)."""
    if size < 1 or worker.world_size % size:
        raise ConfigError(f"option 'context-parallel': {size} does not divide the {worker.world_size} ranks")
    data_rank, rank = divmod(worker.rank, size)
    if size == 1:
        return ContextGroup(1, 0, None, data_rank, worker.world_size)
    mesh = init_device_mesh(worker.device.type, (worker.world_size // size, size), mesh_dim_names=("dp", "cp"))
    return ContextGroup(size, rank, mesh["cp"].get_group(), data_rank, worker.world_size // size)
