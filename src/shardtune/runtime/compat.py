"""Every private torch and peft interface shardtune relies on, each behind a check of its layout.

A new torch or peft may rename or reshape any of these without notice. Each function here checks
what it relies on and raises ``PrivateAPIChanged`` naming the interface and what differed, instead of
returning wrong slices or silently skipping work. Nothing outside this module touches them.

* FSDP1 flat parameters (``FlatParamHandle``): where each original parameter lies in the flat
  parameter and in this rank's slice of it (``fsdp1_layout``).
* DCP's load-target protocol (``__create_chunk_list__`` / ``__get_tensor_shard__``): ``ShardView``,
  a tensor made of rectangles of a parameter, which ``dcp.load`` fills. It replaces the deprecated
  ``ShardedTensor``; a ``DTensor`` cannot describe FSDP1's slices (a flat range cuts rows partway).
* FSDP2's custom all-gather and reduce-scatter (``AllGather``, ``ReduceScatter``): set on a unit by
  ``set_fsdp2_all_gather``/``set_fsdp2_reduce_scatter``, their call signatures checked by
  ``check_fsdp2_comm_interface``; the collectives themselves are in parallel/gloo_comms.py.
* peft's per-adapter device move, wrapped to record LoRA's initial values (``record_lora_init``).
* Fake tensors for the planner's forward pass (``fake_mode``, ``storage_id``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class PrivateAPIChanged(RuntimeError):
    """A private torch/peft interface is not what this shardtune version was written against."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(
            f"{what}: {detail}. shardtune relies on this private interface (runtime/compat.py) and it changed "
            f"(torch {torch.__version__}{_peft_version()}); use the torch/peft versions pinned in pyproject.toml "
            "or update runtime/compat.py"
        )


def _peft_version() -> str:
    try:
        import peft
    except ImportError:
        return ""
    return f", peft {peft.__version__}"


def _need(obj: object, what: str, *attrs: str) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise PrivateAPIChanged(what, f"{type(obj).__name__} has no {', '.join(missing)}")


# --- FSDP1 flat parameters -------------------------------------------------------------------------


@dataclass(frozen=True)
class FlatLayout:
    """Where the original parameters lie in one FSDP1 unit's flat parameter.

    The unpadded flat parameter concatenates the parameters (with alignment padding between them) in
    ``fqns`` order; it is padded at the end to ``shard_numel * world_size`` and rank r holds elements
    ``[r * shard_numel, (r + 1) * shard_numel)``.
    """

    flat: nn.Parameter
    fqns: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]  # of each parameter in the unpadded flat parameter
    aliases: dict[str, str]  # {tied alias: the name it shares its storage with}
    shard_numel: int
    unpadded_numel: int
    rank: int
    world_size: int
    process_group: dist.ProcessGroup

    def local_range(self, i: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of parameter ``i`` (flattened) that this rank holds."""
        numel = math.prod(self.shapes[i])
        start = self.rank * self.shard_numel - self.offsets[i]
        end = min((self.rank + 1) * self.shard_numel, self.unpadded_numel) - self.offsets[i]
        lo = min(max(start, 0), numel)
        return lo, min(max(end, lo), numel)


def fsdp1_flat_param(unit: nn.Module) -> nn.Parameter | None:
    """The flat parameter an FSDP1 unit owns itself (``None``: it holds no parameters of its own)."""
    _need(unit, "FSDP1 FullyShardedDataParallel", "_handle")
    handle = unit._handle
    if handle is None:
        return None
    _need(handle, "FSDP1 FlatParamHandle", "flat_param", "world_size", "rank", "process_group")
    return handle.flat_param


def fsdp1_layout(unit: nn.Module) -> FlatLayout | None:
    """The checked layout of an FSDP1 unit's flat parameter (``None``: the unit owns no parameters).

    Checks FSDP1's own records against the layout computed here: the padding between and after the
    parameters, the even split over ranks, and for every parameter the part of it in this rank's slice
    (``_shard_param_infos``). A mismatch would make loading and ``gather_full`` read the wrong elements.
    """
    flat = fsdp1_flat_param(unit)
    if flat is None:
        return None
    what = "FSDP1 FlatParameter"
    _need(flat, what, "_fqns", "_shapes", "_numels_with_padding", "_is_padding_mask", "_shard_param_infos",
          "_unpadded_unsharded_size", "_shared_param_infos")
    handle = unit._handle
    offsets, names, offset = [], iter(flat._fqns), 0
    if len(flat._numels_with_padding) != len(flat._is_padding_mask):
        raise PrivateAPIChanged(what, "_numels_with_padding and _is_padding_mask differ in length")
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not padding:
            next(names, None)
            offsets.append(offset)
        offset += numel
    fqns, shapes = tuple(flat._fqns), tuple(torch.Size(s) for s in flat._shapes)
    unpadded = flat._unpadded_unsharded_size.numel()
    shard_numel, world = flat.numel(), handle.world_size
    if len(offsets) != len(fqns) or len(shapes) != len(fqns):
        raise PrivateAPIChanged(what, f"{len(offsets)} unpadded entries for {len(fqns)} parameters")
    if offset != unpadded:
        raise PrivateAPIChanged(what, f"its entries add up to {offset} elements, not the unpadded {unpadded}")
    if not 0 <= shard_numel * world - unpadded < world:
        raise PrivateAPIChanged(what, f"a {shard_numel}-element shard on {world} ranks does not hold "
                                      f"{unpadded} elements padded at the end only")
    if any(o + math.prod(s) > (offsets[i + 1] if i + 1 < len(offsets) else unpadded)
           for i, (o, s) in enumerate(zip(offsets, shapes))):
        raise PrivateAPIChanged(what, "its parameters overlap")
    aliases = {f"{s.module_name}.{s.param_name}".lstrip("."): f"{s.prim_module_name}.{s.prim_param_name}".lstrip(".")
               for s in flat._shared_param_infos}
    layout = FlatLayout(flat, fqns, shapes, tuple(offsets), aliases, shard_numel, unpadded, handle.rank, world,
                        handle.process_group)
    infos = flat._shard_param_infos
    if len(infos) != len(fqns):
        raise PrivateAPIChanged(what, f"{len(infos)} _shard_param_infos for {len(fqns)} parameters")
    for i, info in enumerate(infos):
        lo, hi = layout.local_range(i)
        expected = (hi > lo, offsets[i] + lo - layout.rank * shard_numel if hi > lo else None,
                    hi - lo if hi > lo else None)
        if (info.in_shard, info.offset_in_shard, info.numel_in_shard) != expected:
            raise PrivateAPIChanged(
                what, f"rank {layout.rank} holds {fqns[i]} as (in shard, offset, numel) "
                      f"{(info.in_shard, info.offset_in_shard, info.numel_in_shard)}, not {expected}")
    return layout


# --- DCP load targets ------------------------------------------------------------------------------


class ShardView(torch.Tensor):
    """A load target for ``dcp.load``: a tensor of ``shape`` of which this rank holds ``pieces``,
    rectangles given as (offsets, a tensor of their size that is written in place).

    Only a target: ``dcp.load`` asks it which rectangles to read (``__create_chunk_list__``) and where
    to put each (``__get_tensor_shard__``); ``detach`` returns it; any other operation is refused.
    """

    pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                pieces: list[tuple[tuple[int, ...], torch.Tensor]]) -> ShardView:
        view = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        view.pieces = pieces
        return view

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardView(shape={tuple(self.shape)}, pieces={[(o, tuple(t.shape)) for o, t in self.pieces]})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(f"ShardView is a load target for dcp.load only, not a tensor for {func}")

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, tensor in self.pieces:
            if torch.Size(offsets) == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: no local piece at {index.offset}")


@functools.cache
def check_load_target_protocol() -> None:
    """DCP must plan reads from a ``ShardView``'s own pieces and write into them (once per process)."""
    from torch.distributed.checkpoint import planner_helpers, utils
    from torch.distributed.checkpoint.metadata import MetadataIndex

    piece = torch.zeros(1, 2)
    view = ShardView((2, 2), piece.dtype, piece.device, [((1, 0), piece)])
    what = "torch.distributed.checkpoint's load-target protocol (__create_chunk_list__, __get_tensor_shard__)"
    try:
        chunks = planner_helpers._create_chunk_list(view)
        found = utils.find_tensor_shard(view, MetadataIndex("probe", torch.Size((1, 0))))
    except (AttributeError, TypeError, ValueError) as err:
        raise PrivateAPIChanged(what, f"probing it failed: {err}") from err
    if [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] != [((1, 0), (1, 2))] or found is not piece:
        raise PrivateAPIChanged(what, "a load target's own chunks are no longer used")


def piece_boxes(target: torch.Tensor) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
    """(index into the full tensor, where it goes) for each piece of a ``ShardView``, or the whole tensor."""
    if isinstance(target, ShardView):
        for offsets, tensor in target.pieces:
            yield tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape)), tensor
    else:
        yield (), target


# --- FSDP2 custom collectives (gloo) -------------------------------------------------------------


def set_fsdp2_all_gather(unit: nn.Module, comm: object) -> None:
    """``unit.set_custom_all_gather(comm)``, after checking that FSDP2 still calls ``comm`` as
    ``allocate(size, *, dtype, device)`` and ``comm(output_tensor, input_tensor, group, async_op)``."""
    _set_fsdp2_comm(unit, comm, "set_custom_all_gather", "AllGather")


def set_fsdp2_reduce_scatter(unit: nn.Module, comm: object) -> None:
    """``unit.set_custom_reduce_scatter(comm)``, after checking that FSDP2 still calls ``comm`` as
    ``allocate(size, *, dtype, device)`` and ``comm(output_tensor, input_tensor, group, op, async_op)``."""
    _set_fsdp2_comm(unit, comm, "set_custom_reduce_scatter", "ReduceScatter")


#: the parameters FSDP2 calls each custom collective's ``__call__`` with (after self)
FSDP2_COMM_CALLS = {"AllGather": ["output_tensor", "input_tensor", "group", "async_op"],
                    "ReduceScatter": ["output_tensor", "input_tensor", "group", "op", "async_op"]}


def _set_fsdp2_comm(unit: nn.Module, comm: object, setter: str, interface: str) -> None:
    what = f"FSDP2's custom collective ({setter}, {interface})"
    check_fsdp2_comm_interface(what, interface)
    _need(unit, what, setter)
    getattr(unit, setter)(comm)


@functools.cache
def check_fsdp2_comm_interface(what: str, interface: str) -> None:
    """That FSDP2's ``interface`` class still has ``allocate(size, dtype, device)`` and the ``__call__``
    of ``FSDP2_COMM_CALLS``."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_api

        cls = getattr(_fsdp_api, interface)
    except (ImportError, AttributeError) as err:
        raise PrivateAPIChanged(what, str(err)) from err
    call = list(inspect.signature(cls.__call__).parameters)
    allocate = list(inspect.signature(cls.allocate).parameters)
    if call != ["self", *FSDP2_COMM_CALLS[interface]] or allocate != ["self", "size", "dtype", "device"]:
        raise PrivateAPIChanged(what, f"{interface} is called as __call__{call[1:]}, allocate{allocate[1:]}")


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


# --- fake tensors for the planner ------------------------------------------------------------------


def fake_mode() -> contextlib.AbstractContextManager:
    """A ``FakeTensorMode`` that also accepts real inputs: shapes and dtypes without memory or arithmetic."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as err:
        raise PrivateAPIChanged("torch._subclasses.fake_tensor.FakeTensorMode", str(err)) from err
    return FakeTensorMode(allow_non_fake_inputs=True)


def storage_id(t: torch.Tensor) -> int:
    """An id of ``t``'s storage that views share, also for fake tensors (which have no data pointer)."""
    storage = t.untyped_storage()
    _need(storage, "torch.UntypedStorage", "_cdata")
    return storage._cdata


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU (AVX512 or AMX), as torch itself decides it
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, private): False when the op is gone, so a torch
    change costs speed (fp32 on such CPUs under ``--dtype auto``), never correctness."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a torch build without oneDNN
        return False


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
        _need(layer, f"peft {_peft_version()} {type(layer).__name__}", "_disable_adapters")
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was
