"""FSDP's mixed precision for the strategies without FSDP: trainable weights compute in ``--dtype``.

Under FSDP1/FSDP2 every parameter is cast to the compute dtype for forward and backward (their
``param_dtype``), while the optimizer keeps fp32 master weights and fp32 gradients. Without this
module, single and ddp ran LoRA's matmuls in fp32 (peft casts the input up to the adapter's fp32
weight), so ``--strategy auto`` changed the numbers when it switched. Here each module owning a
trainable parameter of another dtype gets a cast copy of it for the duration of its forward (an
instance attribute, which shadows the registered parameter, as FSDP's own unsharded views do), and
its floating inputs are cast too (FSDP's ``cast_forward_inputs``); the shadowing, which relies on how
``nn.Module`` looks attributes up, is runtime/compat's (``shadow_parameter``). Autograd casts the
gradient back to fp32 into the parameter's ``.grad``: the same values FSDP reduces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardtune.runtime.compat import shadow_parameter, unshadow_parameter


def compute_trainable_in(model: nn.Module, dtype: torch.dtype) -> list[RemovableHandle]:
    """Make every trainable parameter of ``model`` compute in ``dtype``; returns the hooks' handles.

    The hooks go on the module whose forward reads the parameter: its owner, except under a peft tuner layer,
    whose own forward reads its adapters' weights without calling them (the fused LoRA forward,
    model/lora_forward.py; DoRA's norm): there the layer casts all of them for the duration of its forward."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    handles, covered = [], set()
    for module in model.modules():
        if id(module) in covered:
            continue
        reader = isinstance(module, BaseTunerLayer)
        owners = list(module.modules()) if reader else [module]
        pairs = [(owner, n) for owner in owners for n, p in owner.named_parameters(recurse=False)
                 if p.requires_grad and p.dtype != dtype]
        if reader:
            covered.update(id(m) for m in owners)
        if pairs:
            handles.append(module.register_forward_pre_hook(_CastIn(pairs, dtype), with_kwargs=True))
            handles.append(module.register_forward_hook(_Restore(pairs), always_call=True))
    return handles


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class _CastIn:
    def __init__(self, pairs: list[tuple[nn.Module, str]], dtype: torch.dtype) -> None:
        self.pairs, self.dtype = pairs, dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for owner, name in self.pairs:
            shadow_parameter(owner, name, self.dtype)
        return tuple(_cast(a, self.dtype) for a in args), {k: _cast(v, self.dtype) for k, v in kwargs.items()}


class _Restore:
    def __init__(self, pairs: list[tuple[nn.Module, str]]) -> None:
        self.pairs = pairs

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        for owner, name in self.pairs:
            unshadow_parameter(owner, name)
