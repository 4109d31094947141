"""``summary.json``: the run's result, gathered from every rank once training and saving are done."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardtune.config import traits
from shardtune.runplan import RunPlan
from shardtune.runtime import distributed
from shardtune.runtime.memory import MemoryMonitor

if TYPE_CHECKING:
    from shardtune.train.job import Job

PHASES = ("load", "train", "save")


def run_summary(job: Job, plan: RunPlan, memory: MemoryMonitor, result: dict, adapter: Path, load_seconds: float,
                wall_seconds: float) -> dict:
    """The summary (a collective: every rank's peaks are gathered; every rank gets the same dict)."""
    cfg, worker, state = job.cfg, job.worker, result["state"]
    peaks = distributed.all_gather_object({**{k: memory.peak_mb(k) for k in PHASES},
                                           "runtime": memory.runtime_mb()})
    cuda_peaks = distributed.all_gather_object(memory.cuda_peaks_mb()) if worker.device.type == "cuda" else None
    return {
        "world_size": worker.world_size, "strategy": job.strategy.name, "dtype": cfg.model.dtype,
        "device": worker.device.type, "backend": str(torch.distributed.get_backend()),
        "objective": job.objective.name,
        "strategy_reason": job.built.strategy_reason,
        "micro_batch_size": job.sampler.plan.micro_batch_size,
        "activation_checkpointing": cfg.parallel.activation_checkpointing,
        "fsdp_unit": cfg.parallel.fsdp_unit if traits(job.strategy.name).fsdp_unit else None,
        "context_parallel": plan.context_parallel,
        "run_plan": plan.as_dict(),
        "steps": job.steps, "tokens": state.tokens,
        "train_loss_first": state.first_loss, "train_loss_last": state.last_loss,
        "val_loss": state.val_loss,
        "tokens_per_second": state.tokens / state.train_seconds if state.train_seconds else None,
        "load_seconds": round(load_seconds, 3),
        "load_peak_mb": [p["load"] for p in peaks], "train_peak_mb": [p["train"] for p in peaks],
        "save_peak_mb": [p["save"] for p in peaks],
        "runtime_mb": [p["runtime"] for p in peaks],  # the planner's "runtime", measured (memory.py)
        # GPU: torch's max_memory_allocated and max_memory_reserved per phase and rank; reserved
        # (allocated plus the caching allocator's free blocks) is what runs out first.
        **({f"cuda_max_{kind}_mb": {k: [c[k][kind] for c in cuda_peaks] for k in PHASES}
            for kind in ("allocated", "reserved")} if cuda_peaks else {}),
        "resumed_from_step": result["first_step"] if cfg.output.resume else None,
        "total_params": job.built.total_params, "trainable_params": job.built.trainable_params,
        "truncated_records": job.train.truncated,
        "packing": cfg.data.packing,
        # real (non-padding) tokens / positions computed, averaged over this process's steps
        "fill_ratio": sum(result["fills"]) / len(result["fills"]) if result["fills"] else None,
        "adapter": str(adapter.resolve()),
        "wall_seconds": round(wall_seconds, 3),
    }
