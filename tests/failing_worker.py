"""A worker for launcher tests: rank 1 raises (naming its compute threads), rank 0 waits in a collective
that never completes."""

import os

import torch.distributed as dist

from shardtune.runtime import distributed

if __name__ == "__main__":
    d = distributed.init_worker()
    if d.rank == 1:
        raise RuntimeError(f"rank one broke on purpose (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
    dist.barrier()  # without rank 1 this waits until the collective timeout, unless the launcher stops it
