"""A worker for launcher tests: rank 1 raises, rank 0 waits in a collective that never completes."""

import torch.distributed as dist

from shardtune.runtime import distributed

if __name__ == "__main__":
    d = distributed.init_worker()
    if d.rank == 1:
        raise RuntimeError("rank one broke on purpose")
    dist.barrier()  # without rank 1 this waits until the collective timeout, unless the launcher stops it
