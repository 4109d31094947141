"""FSDP2 (``fully_shard``): units for the parts of each decoder layer and the root; frozen embeddings
sharded by rows outside FSDP. All applied on the meta device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardtune.model.nf4_fill import is_nf4
from shardtune.model.structure import decoder_layers, embedding_tables, layer_parts, tables_by_rows
from shardtune.parallel import gloo_comms, host_gather, sharded_embeddings
from shardtune.parallel.base import Strategy
from shardtune.parallel.exchanged_layers import exchange_in_place, exchanged_layers
from shardtune.parallel.mesh import data_parallel_mesh, shard_mesh
from shardtune.runplan import GenerationWeights
from shardtune.runtime import compat
from shardtune.runtime.distributed import Worker


class FSDP2(Strategy):
    name = "fsdp2"

    def __init__(self, worker: Worker, compute_dtype: torch.dtype, cpu_offload: bool,
                 replicate_groups: int = 1, unit: str = "part", exchange_layers: bool = False) -> None:
        super().__init__(worker)
        # the frozen projections computed from their row shards, outside FSDP (exchanged_layers.py)
        self.exchange_layers = exchange_layers
        # "layer": one unit per decoder layer, one gather each way per layer (fewer, larger collectives);
        # "part": units for a layer's attention and MLP projections and the rest (model/structure.py)
        self.unit = unit
        self.gather: object | None = None  # CPU: FSDP2's all-gather (host_gather.for_group)
        self.reduce: gloo_comms.DeferredReduceScatter | None = None  # gloo: reduce-scatters finished per step
        # 2-D under HSDP: fully_shard then shards over dim 1 and replicates over dim 0.
        self.mesh = data_parallel_mesh(worker, replicate_groups)
        # LoRA weights are fp32 while a bf16 base is not; FSDP2 needs one dtype per unit for its
        # all-gather, so parameters are cast to the compute dtype there. Gradients are reduced in
        # fp32 so that summing over ranks loses nothing.
        self.mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        self.offload = CPUOffloadPolicy(pin_memory=worker.device.type == "cuda") if cpu_offload else OffloadPolicy()
        self.whole: set[nn.Parameter] = set()  # frozen NF4 weights FSDP leaves alone (``shard``)
        self.exchanged: set[nn.Parameter] = set()  # the row-sharded projections', likewise
        if cpu_offload and worker.device.type == "cuda":
            self.host_params = self._fsdp_managed

    def shard(self, model: nn.Module) -> nn.Module:
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__}: found no decoder layers to shard (_no_split_modules)")
        if shard_mesh(self.mesh).size() == 1:
            # One rank holds the whole weight (one process, or HSDP shard groups of one): there is nothing
            # to gather, and FSDP2's one-rank shortcut copies only the first of a tensor subclass's
            # all-gather inputs, so torchao's NF4 (three: scalers, factors, codes) fails in its
            # post-all-gather. The frozen 4-bit weights stay whole outside FSDP, used in place.
            self.whole = {p for p in model.parameters() if is_nf4(p)}
        elif self.exchange_layers:
            self.exchanged = exchange_in_place(model, shard_mesh(self.mesh), self.mp.param_dtype or torch.float32)
        if self.unit == "layer":
            # Backward starts with the last layer right after forward: resharding it would only gather it
            # again at once (torchtitan keeps it too). Per-part units are chosen to fit, so they reshard.
            units: list[FSDPModule] = [self._unit(layer, reshard_after_forward=layer is not layers[-1])
                                       for layer in layers]
        else:
            units = [self._unit(part) for layer in layers for part in layer_parts(layer)]
        ignored, own_units = self._shard_embeddings(model)
        units += [self._unit(module, reshard_after_forward=reshard) for module, reshard in own_units]
        # The root holds what is left (final norm; embeddings not sharded by rows), needed again at the start
        # of backward: keeping it unsharded after forward saves one all-gather per step.
        units.append(self._unit(model, reshard_after_forward=False, ignored_params=ignored | self._outside()))
        if self.worker.device.type == "cpu":  # gloo's all-gather only: NCCL's is in place already
            self.gather = host_gather.for_group(shard_mesh(self.mesh).get_group())
            for unit in units:
                compat.set_fsdp2_all_gather(unit, self.gather)
            if self.mesh.ndim == 1 and not isinstance(self.offload, CPUOffloadPolicy):  # not HSDP, no offload
                self.reduce = gloo_comms.DeferredReduceScatter()
                for unit in units:
                    compat.set_fsdp2_reduce_scatter(unit, self.reduce)
        if self.unit == "layer":
            # Each layer's forward starts the next layer's gather, which then moves while this one
            # computes (backward prefetches the same way by default). Costs one more gathered layer
            # in forward, where activations are still smaller than in backward.
            for layer, following in zip(units[:len(layers)], units[1:len(layers)]):
                layer.set_modules_to_forward_prefetch([following])
        return model

    def _shard_embeddings(self, model: nn.Module) -> tuple[set[nn.Parameter], list[tuple[nn.Module, bool]]]:
        """Frozen embeddings are used from their row shards, outside FSDP (sharded_embeddings.py).

        Returns the parameters FSDP must leave alone, and the untied tables that still need units of
        their own, with their ``reshard_after_forward``: those that LoRA or modules_to_save train, or
        whose lookup is not a plain one (Gemma scales it). Tied tables go together or stay in the root.
        """
        embed, head, tied = embedding_tables(model)
        by_rows = tables_by_rows(embed, head, tied)
        # Rows are split within the shard group: each replica group holds one copy of the table.
        rows_mesh = shard_mesh(self.mesh)
        group, ignored, units = rows_mesh.get_group(), set(), []
        weight: nn.Parameter | None = None
        if by_rows["embed"]:
            weight = sharded_embeddings.shard_rows(embed.weight, rows_mesh)
            _replace(model, embed, sharded_embeddings.ShardedEmbedding(embed, weight, group))
            ignored.add(weight)
        elif embed is not None and not tied:
            units.append((embed, True))  # freed right after the lookup: its backward never runs
        if by_rows["head"]:
            weight = weight if tied else sharded_embeddings.shard_rows(head.weight, rows_mesh)
            _replace(model, head, sharded_embeddings.ShardedHead(head, weight, group))
            ignored.add(weight)
        elif head is not None and not tied:
            # Gathered at the end of forward and kept for backward, which needs it first; in the
            # root it would stay unsharded for the whole step.
            units.append((head, False))
        return ignored, units

    def _unit(self, module: nn.Module, reshard_after_forward: bool = True,
              ignored_params: set[nn.Parameter] | None = None) -> FSDPModule:
        return fully_shard(module, mesh=self.mesh, mp_policy=self.mp, offload_policy=self.offload,
                           reshard_after_forward=reshard_after_forward,
                           ignored_params=ignored_params if ignored_params is not None else self._outside() or None)

    def _outside(self) -> set[nn.Parameter]:
        return self.whole | self.exchanged

    def gradient_sync(self, model: nn.Module, enabled: bool) -> ContextManager:
        # Without sync every unit keeps its unsharded gradient (only LoRA's are trainable: small)
        # and skips its reduce-scatter; the last micro-batch reduces the sum.
        model.set_requires_gradient_sync(enabled)
        if not enabled or self.reduce is None:
            return contextlib.nullcontext()
        return self._reduced(model)

    @contextlib.contextmanager
    def gathered_for_generation(self, model: nn.Module, weights: GenerationWeights
                                ) -> Iterator[dist.ProcessGroup | None]:
        # The row-sharded tables are used vocabulary-parallel, never gathered (sharded_embeddings.exchanged).
        # ``exchanged``: neither are the layers (exchanged_layers.py), on a shard group of several ranks;
        # ``replicated``: whose ranks each run all of the group's rows (given to the caller, who gathers them).
        # ``gathered``: every unit is gathered once and its forwards run without FSDP2's hooks (a forward per token
        # would otherwise pay every unit's pre- and post-forward hook); meanwhile its frozen shards, rows of
        # what is gathered, are freed (a rank then holds the model once, not once and a shard more), each
        # refilled as the block ends; after, the hooks are back and every unit is sharded again, before any
        # backward or optimizer step, even when generation failed. ``carried`` (and no error): the units stay
        # gathered and their shards freed until the training's backward shards each (refilled just before):
        # its forward and backward then gather none of them, two gathers of the model spared a step.
        group = shard_mesh(self.mesh)
        if weights.exchanged and group.size() > 1:
            with sharded_embeddings.exchanged(model, weights.replicated), \
                    exchanged_layers(model, group.get_group(), self.mp.param_dtype or torch.float32,
                                     weights.replicated):
                yield group.get_group() if weights.replicated else None
            return
        units = [m for m in model.modules() if isinstance(m, FSDPModule)] if weights.gathered else []
        held = False
        with contextlib.ExitStack() as stack:
            # one unit at a time, each way: its shards go as its gathered copy comes, and come back (refilled
            # from it) just before it is sharded again, so that a rank never holds more than one unit twice
            for unit in units:
                stack.callback(lambda unit=unit: None if held else unit.reshard())
                unit.unshard()
                stack.enter_context(compat.fsdp2_frozen_shards_released(unit, hold=lambda: held))
            for unit in units:
                stack.enter_context(compat.fsdp2_forward_hooks_paused(unit))
            stack.enter_context(sharded_embeddings.exchanged(model))
            yield None
            held = weights.carries and group.size() > 1

    def after_inference(self, model: nn.Module) -> None:
        # Units that keep their parameters gathered after forward (the last layer, the head) reshard in
        # backward; after a no_grad forward none comes, and the gathered copy would outlive the next
        # optimizer step: the following forward would compute with the old LoRA weights.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @contextlib.contextmanager
    def _reduced(self, model: nn.Module) -> Iterator[None]:
        """The reducing micro-batch, whose reduce-scatters are all finished when it ends (gloo)."""
        self.reduce.arm(all(p.grad is None for p in model.parameters() if p.requires_grad))
        try:
            yield
        finally:
            self.reduce.wait()

    def full_tensors(self, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        out = {}
        for n in names:
            p = params[n].detach()
            if isinstance(p, DTensor):
                # --cpu-offload keeps shards on the CPU while the mesh is CUDA: gather them over NCCL
                # on the GPU (as torchtune's gather_cpu_state_dict does), not over the slower gloo.
                if p.device.type != self.worker.device.type:
                    p = p.to(self.worker.device)
                p = p.full_tensor()
            out[n] = p.to("cpu", copy=True)
        return out

    def _fsdp_managed(self, model: nn.Module) -> set[int]:
        """Ids of the parameters FSDP2 shards (offloaded to the CPU): all but the row-sharded embeddings',
        the whole NF4 weights and the exchanged projections (``_outside``: used in place on the device)."""
        outside = {id(p) for m in model.modules()
                   if isinstance(m, (sharded_embeddings.ShardedEmbedding, sharded_embeddings.ShardedHead))
                   for p in m.parameters()} | {id(p) for p in self._outside()}
        return {id(p) for p in model.parameters() if id(p) not in outside}


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``old`` sits in the module tree (same name, so parameter names stay)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return new
    raise ValueError(f"{type(old).__name__} is not part of the model")
