"""The strategy interface, and the single-process strategy it is by default."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.distributed as dist
from torch import nn

from shardtune.parallel.mesh import ContextGroup
from shardtune.runplan import GenerationWeights
from shardtune.runtime.distributed import Worker


class Strategy:
    """One process holds the whole model. Subclasses shard or replicate it over ranks."""

    name = "single"
    #: a callable giving {parameter name: tensor to load into}, when that differs from the parameters
    load_targets: Callable[[nn.Module], dict[str, torch.Tensor]] | None = None
    #: with CPU offload on a GPU: ids of the parameters to allocate in host memory (the rest go to the GPU)
    host_params: Callable[[nn.Module], set[int]] | None = None

    def __init__(self, worker: Worker, compute_dtype: torch.dtype | None = None) -> None:
        self.worker = worker
        self.compute_dtype = compute_dtype
        #: data parallelism × context parallelism (``make_strategy`` sets it; none: every rank its own data)
        self.context = ContextGroup(1, 0, None, worker.rank, worker.world_size)

    def shard(self, model: nn.Module) -> nn.Module:
        """Called on the meta model, before any weight exists."""
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """Called once the weights are loaded. Trainable fp32 weights compute in the compute dtype, as
        under FSDP's mixed precision: the numbers do not depend on the strategy."""
        if self.compute_dtype is not None:
            from shardtune.parallel.compute_dtype import compute_trainable_in

            compute_trainable_in(model, self.compute_dtype)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The peft model inside whatever ``wrap`` returned."""
        return model

    def gradient_sync(self, model: nn.Module, enabled: bool) -> ContextManager:
        """Around one micro-batch's forward and backward: with ``enabled`` False, gradients only
        accumulate on this rank; the micro-batch run with it True reduces the sum once per step."""
        return contextlib.nullcontext()

    def gathered_for_generation(self, model: nn.Module, weights: GenerationWeights
                                ) -> ContextManager[dist.ProcessGroup | None]:
        """Around a generation's token-by-token no_grad forwards, holding the weights as ``weights`` says (the
        planner decided what fits: ``RunPlan.generation``). ``gathered``: a sharded strategy gathers the weights
        once and keeps them for all of them, sharding them again when the block ends, even on an error; with
        ``exchanged``, FSDP2 gathers none and computes each projection from its row shards instead
        (parallel/exchanged_layers.py), and with ``replicated`` too, every rank of a shard group runs all of the
        group's rows: the block gives that group, whose rows the caller must gather (None: each rank runs its
        own). With ``gathered`` and ``carried``, when the block ends without an error the weights stay gathered
        for the training that follows, until its backward shards them (the LoRA weights the block generated
        with are the ones that training starts from): the caller must not ``after_inference`` before it. Here
        every rank holds the whole model already: nothing to do."""
        return contextlib.nullcontext()

    def after_inference(self, model: nn.Module) -> None:
        """After forwards under ``no_grad`` (validation, a precomputed reference), before training goes on:
        what the strategy keeps gathered for a backward that will not come is let go."""

    def trainable(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """Trainable parameters by their peft name (what the adapter and optimizer hold)."""
        return {n: p for n, p in self.unwrap(model).named_parameters() if p.requires_grad}

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Global gradient norm over all ranks, before clipping; clips when ``max_norm`` > 0."""
        grads = [p.grad for p in self.trainable(model).values() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(list(self.trainable(model).values()), max_norm, norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_tensors(self, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        """Full (unsharded) copies of the named parameters, on CPU; a collective: every rank calls it."""
        params = dict(self.unwrap(model).named_parameters())
        return {n: params[n].detach().to("cpu", copy=True) for n in names}
