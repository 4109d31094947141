"""The device mesh of the data-parallel ranks: 1-D for FSDP, 2-D (replicate × shard) for HSDP.

``--replicate-groups R`` splits the W ranks into R groups of W/R consecutive ranks (normally one
group per node, so sharding's all-gathers and reduce-scatters stay on the node's fast links); each
group shards the model, and the groups hold replicas whose gradients are all-reduced across them.
Mesh dimension 0 is "replicate", 1 is "shard": the order FSDP2 and FSDP1's HYBRID_SHARD expect.
A 2-D mesh has no single process group (``mesh.get_group()`` raises): what needs the ranks that
share one model copy asks for ``shard_mesh(mesh)``.
"""

from __future__ import annotations

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
