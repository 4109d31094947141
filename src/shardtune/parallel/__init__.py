"""Every way of spreading the model over ranks, applied in one place: ``parallelize``.

The training loop sees only the returned ``Strategy``; it never imports FSDP or DDP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardtune.model.structure import base_model, decoder_layers
from shardtune.parallel.base import Strategy
from shardtune.parallel.mesh import context_group
from shardtune.runplan import RunPlan
from shardtune.runtime.distributed import Worker

__all__ = ["Strategy", "make_strategy", "parallelize"]


def make_strategy(plan: RunPlan, worker: Worker, compute_dtype: torch.dtype) -> Strategy:
    """The strategy of a run plan (which options combine was checked when the plan was made, once):
    its ``replicate_groups`` > 1 means HSDP (shard within groups, replicate across them), its
    ``fsdp_unit`` FSDP2's unit of sharding; its ``context_parallel`` the groups of ranks that share their
    micro-batches and cut each sequence among them (``Strategy.context``)."""
    strategy = _strategy(plan, worker, compute_dtype)
    strategy.context = context_group(worker, plan.context_parallel)
    return strategy


def _strategy(plan: RunPlan, worker: Worker, compute_dtype: torch.dtype) -> Strategy:
    if plan.strategy == "fsdp2":
        from shardtune.parallel.fsdp2 import FSDP2

        return FSDP2(worker, compute_dtype, plan.cpu_offload, plan.replicate_groups, plan.fsdp_unit,
                     plan.layers_exchanged)
    if plan.strategy == "fsdp1":
        from shardtune.parallel.fsdp1 import FSDP1

        return FSDP1(worker, compute_dtype, plan.cpu_offload, plan.replicate_groups)
    if plan.strategy == "ddp":
        from shardtune.parallel.ddp import DDPStrategy

        return DDPStrategy(worker, compute_dtype)
    if plan.strategy == "single":
        return Strategy(worker, compute_dtype)
    raise ValueError(f"unknown strategy {plan.strategy!r}")


def parallelize(
    model: nn.Module,
    strategy: Strategy,
    load: Callable[[nn.Module], object],
    activation_checkpointing: bool,
    mlp_tile: int = 0,
    recompute_dequantized: bool = False,
) -> nn.Module:
    """Apply, in this order: MLP tiling → activation checkpointing → sharding (on meta) → loading → wrapping.

    Tiling replaces each MLP's forward, which the layer (checkpointed or not) calls; checkpointing goes
    before sharding so that sharding wraps the checkpointed blocks; sharding happens on the meta device,
    so that ``load`` allocates and reads only each rank's shard; wrappers that need real weights (DDP
    broadcasts them) come last. ``recompute_dequantized``: a checkpointed layer's recompute keeps its 4-bit
    weights' dequantized values for their backward (``RunPlan.recompute_dequantized``).
    """
    if mlp_tile:
        from shardtune.parallel.tiling import tile_mlps

        tile_mlps(decoder_layers(model), mlp_tile)
    if activation_checkpointing:
        base = base_model(model)
        how: dict = {"use_reentrant": False}
        if recompute_dequantized:
            from shardtune.model.nf4_torchao import checkpoint_contexts

            how["context_fn"] = checkpoint_contexts
        enable = getattr(base, "activation_checkpointing_enable", None)  # transformers 5.25's name
        if enable is not None:
            enable(activation_checkpointing_kwargs=how)
        else:  # its old name, a FutureWarning from 5.25 on
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=how)
    model = strategy.shard(model)
    load(model)  # into the places the strategy made (Strategy.load_targets, host_params)
    return strategy.wrap(model)
