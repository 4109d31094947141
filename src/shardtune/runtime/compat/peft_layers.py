"""peft's private interfaces: its per-adapter device move (wrapped to record LoRA's initial values) and
the adapter layers' own switch (to run the model as its base under any wrapper)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardtune.runtime.compat.changed import PrivateAPIChanged, need, versions

# --- peft: LoRA's initial values ------------------------------------------------------------------


@contextlib.contextmanager
def record_lora_init(record: Callable[[nn.Module], None]) -> Iterator[None]:
    """While active, peft calls ``record(layer)`` on each tuner layer right after creating and
    initialising an adapter, before moving it to the base layer's device (meta, on a meta model)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    name = "_move_adapter_to_device_of_base_layer"
    what = f"peft's BaseTunerLayer.{name}"
    move = getattr(BaseTunerLayer, name, None)
    if move is None:
        raise PrivateAPIChanged(what, "it does not exist")
    params = list(inspect.signature(move).parameters)
    if params[:3] != ["self", "adapter_name", "device"]:
        raise PrivateAPIChanged(what, f"its parameters are {params}")

    def record_then_move(self: BaseTunerLayer, adapter_name: str, device: torch.device | None = None) -> None:
        record(self)
        move(self, adapter_name, device)

    setattr(BaseTunerLayer, name, record_then_move)
    try:
        yield
    finally:
        setattr(BaseTunerLayer, name, move)


# --- peft: the base model without its adapters ----------------------------------------------------


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base model: every peft adapter layer (LoRA, DoRA, modules_to_save) passes
    its input to the base layer alone.

    peft's own ``PeftModel.disable_adapter()`` is out of reach once a wrapper (FSDP1, DDP) holds the peft
    model, and its ``enable_adapters(False)`` also flips ``requires_grad``, which FSDP1's flat parameters and
    the optimizer must never see. The layers' private ``_disable_adapters`` flag is what their forward
    reads; setting it on each layer works under every wrapper and leaves the parameters alone.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    for layer in layers:
        need(layer, f"peft {versions()} {type(layer).__name__}", "_disable_adapters")
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was
