"""FSDP2 (``fully_shard``): units for the parts of each decoder layer and the root; frozen embeddings
sharded by rows outside FSDP. All applied on the meta device."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardtune.model.structure import decoder_layers, embedding_tables, layer_parts, tables_by_rows
from shardtune.parallel import sharded_embeddings
from shardtune.parallel.base import Strategy
from shardtune.runtime.distributed import Worker


class FSDP2(Strategy):
    name = "fsdp2"

    def __init__(self, worker: Worker, compute_dtype: torch.dtype, cpu_offload: bool, unit: str = "part") -> None:
        super().__init__(worker)
        # "layer": one unit per decoder layer, one gather each way per layer (fewer, larger collectives);
        # "part": units for a layer's attention and MLP projections and the rest (model/structure.py)
        self.unit = unit
        self.mesh = init_device_mesh(worker.device.type, (worker.world_size,))
        # LoRA weights are fp32 while a bf16 base is not; FSDP2 needs one dtype per unit for its
        # all-gather, so parameters are cast to the compute dtype there. Gradients are reduced in
        # fp32 so that summing over ranks loses nothing.
        self.mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        self.offload = CPUOffloadPolicy(pin_memory=worker.device.type == "cuda") if cpu_offload else OffloadPolicy()

    def shard(self, model: nn.Module) -> nn.Module:
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__}: found no decoder layers to shard (_no_split_modules)")
        parts = (lambda layer: [layer]) if self.unit == "layer" else layer_parts
        units: list[FSDPModule] = [self._unit(part) for layer in layers for part in parts(layer)]
        ignored, own_units = self._shard_embeddings(model)
        units += [self._unit(module, reshard_after_forward=reshard) for module, reshard in own_units]
        # The root holds what is left (final norm; embeddings not sharded by rows), needed again at the start
        # of backward: keeping it unsharded after forward saves one all-gather per step.
        units.append(self._unit(model, reshard_after_forward=False, ignored_params=ignored))
        if self.mesh.get_group().name() == "gloo":
            gather = BroadcastAllGather()
            for unit in units:
                unit.set_custom_all_gather(gather)
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
        group, ignored, units = self.mesh.get_group(), set(), []
        weight: nn.Parameter | None = None
        if by_rows["embed"]:
            weight = sharded_embeddings.shard_rows(embed.weight, self.mesh)
            _replace(model, embed, sharded_embeddings.ShardedEmbedding(embed, weight, group))
            ignored.add(weight)
        elif embed is not None and not tied:
            units.append((embed, True))  # freed right after the lookup: its backward never runs
        if by_rows["head"]:
            weight = weight if tied else sharded_embeddings.shard_rows(head.weight, self.mesh)
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
                           reshard_after_forward=reshard_after_forward, ignored_params=ignored_params)

    def gradient_sync(self, model: nn.Module, enabled: bool) -> ContextManager:
        # Without sync every unit keeps its unsharded gradient (only LoRA's are trainable: small)
        # and skips its reduce-scatter; the last micro-batch reduces the sum.
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def full_tensors(self, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        out = {}
        for n in names:
            p = params[n].detach()
            out[n] = (p.full_tensor() if isinstance(p, DTensor) else p).to("cpu", copy=True)
        return out


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``old`` sits in the module tree (same name, so parameter names stay)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return new
    raise ValueError(f"{type(old).__name__} is not part of the model")


class BroadcastAllGather:
    """FSDP2's all-gather as one in-place broadcast per rank, for gloo (FSDP2's ``AllGather``
    interface: ``allocate`` and ``__call__``; the class itself is private to torch).

    Gloo's all-gather receives into a new flat tensor of the full size and copies that into the
    output; with FSDP2's input (a slice of the output) it held 2× the gathered size on top of the
    output (measured: 168 MB extra to gather 84 MB) and took 120 ms. Broadcasting each rank's slice
    in place moves the same bytes, allocates nothing and took 30 ms.

    All broadcasts are issued at once and returned as one handle. Gloo runs them on its own threads,
    so a gather FSDP2 prefetches (the next layer's, in forward and backward) moves while this rank
    computes. A handle also marks the gather as asynchronous, and FSDP2 then frees the gather buffer
    right after copying it out, instead of keeping it until the next unit's gather to overlap the two
    on CUDA streams (on CPU that only holds one more buffer).
    """

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        chunks = output_tensor.chunk(world)
        if input_tensor.data_ptr() != chunks[rank].data_ptr():
            chunks[rank].copy_(input_tensor)
        return _AllOf([dist.broadcast(chunks[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
                       for r in range(world)])


class _AllOf(dist.Work):
    """One handle for several collectives: gloo may finish them on different threads in any order."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: object = None) -> bool:
        for work in self.works:
            work.wait()
        return True
