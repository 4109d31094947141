"""``--strategy auto``: the fastest strategy whose memory fits, with the reason in words."""

from __future__ import annotations

import os

import torch

from shardtune.runtime.distributed import Worker

# A replicated model also needs activations, logits, LoRA state and the runtime: replicate only
# when the weights take at most this share of a rank's memory.
REPLICATE_SHARE = 0.5


def memory_per_rank(worker: Worker, local_world_size: int) -> int:
    """Bytes one rank may use: its GPU's memory, or on CPU the available RAM split over local ranks."""
    if worker.device.type == "cuda":
        return torch.cuda.get_device_properties(worker.device).total_memory
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return available // max(1, local_world_size)


def choose_strategy(
    requested: str, worker: Worker, weight_bytes: int, local_world_size: int, cpu_offload: bool
) -> tuple[str, str]:
    """(strategy, why). ``weight_bytes``: the base weights in the compute dtype."""
    gib = 1024**3
    if requested != "auto":
        return requested, "requested"
    if worker.world_size == 1:
        return "single", "one process"
    if cpu_offload:
        return "fsdp2", "CPU offload needs FSDP"
    budget = memory_per_rank(worker, local_world_size)
    if weight_bytes <= REPLICATE_SHARE * budget:
        return "ddp", (
            f"the whole model ({weight_bytes / gib:.2f} GiB) fits comfortably in each rank's "
            f"{budget / gib:.1f} GiB, and replicas need no weight all-gathers"
        )
    return "fsdp2", (
        f"the whole model ({weight_bytes / gib:.2f} GiB) does not fit comfortably in each rank's "
        f"{budget / gib:.1f} GiB; each rank holds 1/{worker.world_size} of it"
    )
