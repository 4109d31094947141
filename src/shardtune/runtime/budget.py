"""How much memory one rank may plan for when --memory-per-rank is not given: said with where it came from.

CPU: the available RAM (``MemAvailable``) split over the node's ranks. GPU: the memory free on the
GPU now (``torch.cuda.mem_get_info``: what other processes hold is gone already) less
``GPU_MARGIN`` of it, which the plan does not model: the caching allocator's fragmentation
(reserved above allocated, which grows with what the run allocates, so with the free memory it may
use) and small allocations of libraries. The CUDA context and NCCL's buffers are terms of the
prediction itself (train/memory_model.py).

Reading a GPU's free memory makes a CUDA context on it. A rank reads its own GPU, where it makes
one anyway; the launcher, which must hold no context during the run, asks a short-lived child
process for all of its node's GPUs.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import torch

from shardtune.config import ConfigError
from shardtune.runtime.memory import format_size

#: The share of a GPU's free memory the automatic budget leaves unplanned.
GPU_MARGIN = 0.10

_PROBE = "import json, sys, torch; print(json.dumps([torch.cuda.mem_get_info(int(i)) for i in sys.argv[1:]]))"


def memory_per_rank(device: torch.device, local_ranks: int) -> tuple[int, str]:
    """(bytes one rank may use, where that number came from, for ``plan`` and the auto choice)."""
    if device.type == "cuda":
        free, total = gpu_memory(local_ranks)
        margin = int(GPU_MARGIN * free)
        return max(0, free - margin), (f"free GPU memory {format_size(free)} of {format_size(total)}, less a "
                                       f"{GPU_MARGIN:.0%} margin of {format_size(margin)} for fragmentation")
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    ranks = max(1, local_ranks)
    return available // ranks, f"available RAM / {ranks} local rank{'s' * (ranks > 1)}"


@functools.cache
def gpu_memory(local_ranks: int) -> tuple[int, int]:
    """(free, total) bytes of the tightest GPU the node's ranks use, read once per process."""
    if "LOCAL_RANK" in os.environ:  # a rank (torchrun's or ours): its own GPU
        free, total = torch.cuda.mem_get_info(int(os.environ["LOCAL_RANK"]))
        return int(free), int(total)
    return min(probe_in_child(list(range(max(1, local_ranks)))))


def probe_in_child(indices: list[int]) -> list[tuple[int, int]]:
    """``torch.cuda.mem_get_info`` of GPUs ``indices``, asked by a child process (its contexts go with it)."""
    try:
        run = subprocess.run([sys.executable, "-c", _PROBE, *map(str, indices)], capture_output=True, text=True,
                             timeout=300)
        lines = run.stdout.strip().splitlines()
        if run.returncode or not lines:
            raise RuntimeError((run.stderr.strip().splitlines() or ["no output"])[-1])
        return [(int(free), int(total)) for free, total in json.loads(lines[-1])]
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"could not read the free memory of GPUs {indices} (torch.cuda.mem_get_info in a child "
                          f"process: {err}); give --memory-per-rank SIZE to plan against a size of your own") from None
