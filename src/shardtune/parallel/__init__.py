"""Every way of spreading the model over ranks, applied in one place: ``parallelize``.

The training loop sees only the returned ``Strategy``; it never imports FSDP or DDP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardtune.model.structure import base_model
from shardtune.parallel.base import Strategy
from shardtune.runtime.distributed import Worker

__all__ = ["Strategy", "make_strategy", "parallelize"]


def make_strategy(name: str, worker: Worker, compute_dtype: torch.dtype, cpu_offload: bool,
                  replicate_groups: int = 1, fsdp_unit: str = "part") -> Strategy:
    """The strategy of a run plan (runplan.py: which options combine was checked there, once).
    ``replicate_groups`` > 1: HSDP: shard within groups, replicate across them.
    ``fsdp_unit``: FSDP2's unit of sharding, "layer" or "part"."""
    if name == "fsdp2":
        from shardtune.parallel.fsdp2 import FSDP2

        return FSDP2(worker, compute_dtype, cpu_offload, replicate_groups, fsdp_unit)
    if name == "fsdp1":
        from shardtune.parallel.fsdp1 import FSDP1

        return FSDP1(worker, compute_dtype, cpu_offload, replicate_groups)
    if name == "ddp":
        from shardtune.parallel.ddp import DDPStrategy

        return DDPStrategy(worker, compute_dtype)
    if name == "single":
        return Strategy(worker, compute_dtype)
    raise ValueError(f"unknown strategy {name!r}")


def parallelize(
    model: nn.Module,
    strategy: Strategy,
    load: Callable[[nn.Module, Callable | None], object],
    activation_checkpointing: bool,
) -> nn.Module:
    """Apply, in this order: activation checkpointing → sharding (on meta) → loading → wrapping.

    Checkpointing goes first so that sharding wraps the checkpointed blocks; sharding happens on the
    meta device, so that ``load`` allocates and reads only each rank's shard; wrappers that need real
    weights (DDP broadcasts them) come last.
    """
    if activation_checkpointing:
        base = base_model(model)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = strategy.shard(model)
    load(model, strategy.load_targets)
    return strategy.wrap(model)
