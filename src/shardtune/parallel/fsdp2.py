"""FSDP2 (``fully_shard``): one unit per decoder layer plus the root, sharded on the meta device."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardtune.distributed import Dist
from shardtune.model import decoder_layers
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
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=self.mp, offload_policy=self.offload)
        # The root (embeddings, final norm, lm_head) is needed again right at the start of backward:
        # keeping it unsharded after forward saves one all-gather per step.
        fully_shard(model, mesh=self.mesh, mp_policy=self.mp, offload_policy=self.offload, reshard_after_forward=False)
        return model

    def full_tensors(self, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        out = {}
        for n in names:
            p = params[n].detach()
            out[n] = (p.full_tensor() if isinstance(p, DTensor) else p).to("cpu", copy=True)
        return out
