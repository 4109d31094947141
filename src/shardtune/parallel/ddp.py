"""DDP: the whole model on every rank, gradients of the trainable parameters all-reduced."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager as ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardtune.parallel.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.worker.device.index] if self.worker.device.type == "cuda" else None
        # Every rank loaded the same weights and the same LoRA init, so DDP's initial broadcast of the
        # whole model would only cost a second full-size buffer.
        model = super().wrap(model)
        return DistributedDataParallel(model, device_ids=device_ids, init_sync=False)

    def gradient_sync(self, model: nn.Module, enabled: bool) -> ContextManager:
        return contextlib.nullcontext() if enabled else model.no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model
