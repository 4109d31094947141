"""A user's own script: collectives on Python tensors, then a plain interpreter exit.

The process group outlives ``destroy_process_group`` here, as it does when a sharded model's device
meshes hold it: gloo's threads then still drop the last collectives' tensors while Python exits.
"""

import torch
import torch.distributed as dist

from shardtune.runtime import distributed


def main() -> dist.ProcessGroup:
    distributed.init_worker("cpu")
    group = dist.group.WORLD
    for _ in range(20):
        dist.all_reduce(torch.ones(1000))
    dist.destroy_process_group()
    return group


if __name__ == "__main__":
    held = main()
