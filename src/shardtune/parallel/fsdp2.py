"""FSDP2 (``fully_shard``): one unit per decoder layer, the embeddings and the root, sharded on meta."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardtune.distributed import Dist
from shardtune.model import base_model, decoder_layers
from shardtune.parallel.base import Strategy


class FSDP2(Strategy):
    name = "fsdp2"

    def __init__(self, dist: Dist, compute_dtype: torch.dtype, cpu_offload: bool) -> None:
        super().__init__(dist)
        self.mesh = init_device_mesh(dist.device.type, (dist.world_size,))
        # LoRA weights are fp32 while a bf16 base is not; FSDP2 needs one dtype per unit for its
        # all-gather, so parameters are cast to the compute dtype there. Gradients are reduced in
        # fp32 so that summing over ranks loses nothing.
        self.mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        self.offload = CPUOffloadPolicy(pin_memory=dist.device.type == "cuda") if cpu_offload else OffloadPolicy()

    def shard(self, model: nn.Module) -> nn.Module:
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__}: found no decoder layers to shard (_no_split_modules)")
        units: list[FSDPModule] = [self._unit(layer) for layer in layers]
        embed, head = _embeddings(model)
        if embed is not None and head is not None:
            # Own units, so that neither stays unsharded while the layers run: the input embedding is
            # freed right after the lookup (its backward never runs), the output one is gathered at the
            # end of forward, kept for backward, which needs it first, and freed after its backward.
            # In the root, both stayed unsharded from forward through all of backward (and were
            # gathered into one buffer, then copied out: twice their size at the start of each step).
            units += [self._unit(embed), self._unit(head, reshard_after_forward=False)]
        # The root holds what is left (final norm; tied embeddings), needed again right at the start
        # of backward: keeping it unsharded after forward saves one all-gather per step.
        units.append(self._unit(model, reshard_after_forward=False))
        if self.mesh.get_group().name() == "gloo":
            gather = BroadcastAllGather()
            for unit in units:
                unit.set_custom_all_gather(gather)
        return model

    def _unit(self, module: nn.Module, reshard_after_forward: bool = True) -> FSDPModule:
        return fully_shard(module, mesh=self.mesh, mp_policy=self.mp, offload_policy=self.offload,
                           reshard_after_forward=reshard_after_forward)

    def full_tensors(self, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        out = {}
        for n in names:
            p = params[n].detach()
            out[n] = (p.full_tensor() if isinstance(p, DTensor) else p).to("cpu", copy=True)
        return out


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input and output embedding modules when they share no parameter (untied), else (None, None)."""
    base = base_model(model)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    if not isinstance(embed, nn.Module) or not isinstance(head, nn.Module):
        return None, None
    if {id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()}:
        return None, None  # tied: one weight can live in one unit only, the root's
    return embed, head


class BroadcastAllGather:
    """FSDP2's all-gather as one in-place broadcast per rank, for gloo (FSDP2's ``AllGather``
    interface: ``allocate`` and ``__call__``; the class itself is private to torch).

    Gloo's all-gather receives into a new flat tensor of the full size and copies that into the
    output; with FSDP2's input (a slice of the output) it held 2× the gathered size on top of the
    output (measured: 168 MB extra to gather 84 MB) and took 120 ms. Broadcasting each rank's slice
    in place moves the same bytes, allocates nothing and took 30 ms.

    The last broadcast is left for FSDP2 to wait on. A handle marks the gather as asynchronous, and
    FSDP2 then frees the gather buffer right after copying it out, instead of keeping it until the
    next unit's gather to overlap the two on CUDA streams (on CPU that only holds one more buffer).
    """

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        chunks = output_tensor.chunk(world)
        if input_tensor.data_ptr() != chunks[rank].data_ptr():
            chunks[rank].copy_(input_tensor)
        work = None
        for r in range(world):
            # Earlier broadcasts complete before the next starts: gloo runs ops on several threads,
            # so only one handle can stand for all of them.
            work = dist.broadcast(chunks[r], src=dist.get_global_rank(group, r), group=group,
                                  async_op=r == world - 1)
        return work
