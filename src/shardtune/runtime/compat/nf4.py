"""torchao's NF4 tensor: a private module path (torchao's ``quantize_`` workflows), the fields shardtune
reads and writes of an ``NF4Tensor``, and two of its methods routed through shardtune's own
(model/nf4_torchao.py), each after a probe shows that both give the same values."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from shardtune.runtime.compat.changed import PrivateAPIChanged, need

NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
#: what shardtune uses of the module (quantize.py, nf4_fill.py) and of an NF4Tensor (nf4_torchao.py, nf4_fill.py)
MODULE_NAMES = ("NF4Tensor", "SubclassTensorArgs", "to_nf4", "get_block_absmax", "NF4_TORCH_FUNCTIONS")
TENSOR_FIELDS = ("block_size", "n_blocks", "scaler_block_size", "quantized_scalers", "quantization_factor",
                 "scaler_mean", "quantized_data", "nf4", "dequantize_scalers", "get_original_weight",
                 "quantize_tensor_nearest", "convert_to_norm_float_weight")


def nf4_tensor_module(import_module: Callable[[str], ModuleType]) -> ModuleType:
    """torchao's NF4 module, imported with ``import_module`` (ImportError when torchao is missing), after
    checking that it and its tensors have what shardtune reads and writes."""
    module = import_module(NF4_MODULE)
    _check_layout(module)
    return module


@functools.cache
def _check_layout(module: ModuleType) -> None:
    what = f"torchao's {NF4_MODULE}"
    need(module, what, *MODULE_NAMES)
    need(module.NF4Tensor, f"{what}.NF4Tensor", "from_tensor")
    probe = module.NF4Tensor.from_tensor(torch.linspace(-3, 5, 4 * 128).reshape(4, 128), 64, 2)
    need(probe, f"{what}.NF4Tensor", *TENSOR_FIELDS)


def route_nf4_method(module: ModuleType, name: str, replacement: Callable, agrees: Callable[[Callable], bool],
                     static: bool = False) -> None:
    """Route ``NF4Tensor.<name>`` through ``replacement`` (once per process), after ``agrees(original)``
    shows on a probe that both give the same values: a torchao that computes otherwise fails here,
    loudly, instead of computing something else. torchao's own stays as ``NF4Tensor._torchao_<name>``."""
    cls = module.NF4Tensor
    if getattr(cls, f"_shardtune_{name}", False):
        return
    what = f"torchao's NF4Tensor.{name}"
    original = getattr(cls, name, None)
    if original is None:
        raise PrivateAPIChanged(what, "it does not exist")
    if not agrees(original):
        raise PrivateAPIChanged(what, "it gives other values than shardtune's replacement of it")
    setattr(cls, f"_torchao_{name}", original if not static else staticmethod(original))
    setattr(cls, name, staticmethod(replacement) if static else replacement)
    setattr(cls, f"_shardtune_{name}", True)


def route_nf4_torch_function(module: ModuleType, func: Callable, replacement: Callable,
                             agrees: Callable[[Callable], bool]) -> None:
    """Route what ``func`` (a torch function, e.g. ``F.linear``) does on an NF4Tensor through ``replacement``
    (once per process), after ``agrees(original)`` shows on a probe that both give the same values, as
    ``route_nf4_method``. torchao keeps its torch-function overrides in ``NF4_TORCH_FUNCTIONS``."""
    table = module.NF4_TORCH_FUNCTIONS
    original = table.get(func)
    if original is replacement:
        return
    what = f"torchao's NF4Tensor {getattr(func, '__name__', func)}"
    if original is None:
        raise PrivateAPIChanged(what, "NF4_TORCH_FUNCTIONS has no entry for it")
    if not agrees(original):
        raise PrivateAPIChanged(what, "it gives other values than shardtune's replacement of it")
    table[func] = replacement
