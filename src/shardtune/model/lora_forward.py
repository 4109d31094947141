"""LoRA's forward with the adapter's update added inside its second matmul.

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: after the base projection
a matmul, a product and a sum, each writing a new tensor of the layer's output size, and autograd keeps the
product's and the sum's gradients too. ``torch.addmm(result, x·A, Bᵀ, alpha=scaling)`` is the same sum in
one operation: one output tensor instead of three, two fewer kernels per projection in every forward (on
CUDA, cuBLAS adds ``result`` in the matmul's epilogue), in training and in every token of a generation.
The values are the same up to the rounding of the sum.

Only plain LoRA layers take it: one active adapter, unmerged, enabled, no DoRA or other variant, no bias
on ``lora_B``, called with the input alone (peft's ``adapter_names`` and the like are peft's to read), and
``lora_A`` / ``lora_B`` plain ``nn.Linear`` modules (under FSDP1 each is a unit of its own, gathered only by
calling it). Everything else runs peft's own forward unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtune.runtime.compat.changed import need, versions

_FUSED: dict[type, type] = {}


#: peft's per-layer state the fused forward reads directly: its properties cost more than the sum they spare
_STATE = ("_disable_adapters", "merged_adapters", "active_adapter", "lora_variant", "lora_A", "lora_B", "scaling")


def _fusable(layer: Any, name: str | None, a: nn.Module | None, b: nn.Module | None) -> bool:
    """Whether adapter ``name`` of ``layer``, with these lora_A and lora_B, can take the fused path (module doc)."""
    return (name is not None and name not in layer.lora_variant and type(a) is nn.Linear and type(b) is nn.Linear
            and b.bias is None)


def fused_class(cls: type) -> type:
    """``cls`` (a peft ``lora.Linear`` class) with the fused forward; one subclass per class."""
    if cls in _FUSED:
        return _FUSED[cls]
    peft_forward = cls.forward

    def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # arguments (peft's adapter_names...) are peft's to read; so are disabled and merged adapters
        if args or kwargs or self._disable_adapters or self.merged_adapters:
            return peft_forward(self, x, *args, **kwargs)
        active = self.active_adapter
        name = active if isinstance(active, str) else active[0] if len(active) == 1 else None
        a, b = self.lora_A._modules.get(name), self.lora_B._modules.get(name)
        if not _fusable(self, name, a, b):  # asked at each call: FSDP1 wraps them in units after injection
            return peft_forward(self, x, *args, **kwargs)
        result = self.base_layer(x)
        xa = a(self.lora_dropout[name](self._cast_input_dtype(x, a.weight.dtype)))
        weight = b.weight
        # peft adds in the adapter's dtype and casts the sum back to the base's: so does this
        flat = result.reshape(-1, result.shape[-1]).to(weight.dtype)
        out = torch.addmm(flat, xa.reshape(-1, xa.shape[-1]), weight.t(), alpha=self.scaling[name])
        return out.view(result.shape).to(result.dtype)

    _FUSED[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                              "__qualname__": cls.__qualname__})
    return _FUSED[cls]


def fuse_lora_forward(model: nn.Module) -> int:
    """Give every peft ``lora.Linear`` of ``model`` the fused forward (module doc); returns how many.

    The layers keep their class's behaviour otherwise (a subclass: merging, saving and peft's own checks
    are unchanged)."""
    from peft.tuners.lora.layer import Linear

    count = 0
    for module in model.modules():
        cls = type(module)
        if issubclass(cls, Linear) and cls not in _FUSED.values():
            need(module, f"peft {versions()} {cls.__name__}", *_STATE)
            module.__class__ = fused_class(cls)
            count += 1
    return count
