"""FSDP's private interfaces: FSDP1's flat parameters (where each original parameter lies in the flat
parameter and in this rank's slice of it) and FSDP2's custom all-gather and reduce-scatter (the
collectives themselves are in parallel/gloo_comms.py and parallel/host_gather.py)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardtune.runtime.compat.changed import PrivateAPIChanged, need

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
    need(unit, "FSDP1 FullyShardedDataParallel", "_handle")
    handle = unit._handle
    if handle is None:
        return None
    need(handle, "FSDP1 FlatParamHandle", "flat_param", "world_size", "rank", "process_group")
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
    need(flat, what, "_fqns", "_shapes", "_numels_with_padding", "_is_padding_mask", "_shard_param_infos",
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
    need(unit, what, setter)
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


@contextlib.contextmanager
def fsdp2_forward_hooks_paused(unit: nn.Module) -> Iterator[None]:
    """Until the block ends, ``unit``'s forwards run without FSDP2's pre- and post-forward hooks (no
    all-gather, no reshard: the module computes from whatever its parameters hold); then the hooks are
    back where they were, before and after any others, even on an error."""
    what = "FSDP2's forward hooks (the unit state's _pre_forward_hook_handle and _post_forward_hook_handle)"
    need(unit, what, "_get_fsdp_state")
    state = unit._get_fsdp_state()
    need(state, what, "_pre_forward_hook_handle", "_post_forward_hook_handle")
    ids = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
    tables = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")
    need(unit, what, *tables)
    saved = {name: dict(getattr(unit, name)) for name in tables}
    if not ids <= set(saved["_forward_pre_hooks"]) | set(saved["_forward_hooks"]):
        raise PrivateAPIChanged(what, f"{type(unit).__name__}'s hooks are not where the handles say")
    try:
        for name in tables:
            for i in ids:
                getattr(unit, name).pop(i, None)
        yield
    finally:
        for name, entries in saved.items():
            table = getattr(unit, name)
            added = {k: v for k, v in table.items() if k not in entries}
            table.clear()
            table.update(entries)
            table.update(added)


@contextlib.contextmanager
def fsdp2_frozen_shards_released(unit: nn.Module, hold: Callable[[], bool] = lambda: False) -> Iterator[int]:
    """While ``unit`` is held gathered (its ``unshard()`` done), each frozen parameter's own shard is rows of
    the gathered copy: its storage is freed until the block ends, then refilled from the gathered copy (the
    very bits the gather copied from it; the padding zero again) before anything can shard the unit again,
    even on an error. Yields the bytes freed. Left alone: trainable parameters (the optimizer steps their
    shards), and any whose gathered copy is not a plain tensor of the shard's dtype and device (a
    mixed-precision cast, CPU offload, a tensor subclass such as NF4, a DTensor), or shares storage.

    ``hold()`` true when the block ends without an error: the unit stays gathered, its shards freed, for the
    forwards and backwards that follow (``fsdp2_held_until_resharded``)."""
    what = "FSDP2's parameters (FSDPParamGroup.fsdp_params: _sharded_param_data, _unsharded_param)"
    need(unit, what, "_get_fsdp_state")
    group = unit._get_fsdp_state()._fsdp_param_group
    freed: list[tuple[object, torch.Tensor, int]] = []
    if group is not None:
        need(group, what, "fsdp_params")
        for param in group.fsdp_params:
            need(param, what, "_sharded_param_data", "sharded_param", "padded_sharded_param_size", "sharded_size",
                 "fsdp_placement", "mesh_info", "sharded_state")
            if param.sharded_param.requires_grad or param.sharded_state.name != "UNSHARDED":
                continue
            shard, whole = param._sharded_param_data, getattr(param, "_unsharded_param", None)
            if type(shard) is not torch.Tensor or whole is None or type(whole.data) is not torch.Tensor \
                    or whole.dtype != shard.dtype or whole.device != shard.device or param.fsdp_placement.dim != 0 \
                    or whole.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
                continue
            storage = shard.untyped_storage()
            # the storage must be the shard's alone (a view into a larger one would free its neighbours)
            if storage.nbytes() and shard.storage_offset() == 0 and storage.nbytes() == shard.nbytes:
                freed.append((param, whole, storage.nbytes()))
                storage.resize_(0)
    try:
        yield sum(nbytes for _, _, nbytes in freed)
    except BaseException:
        _refill(freed)
        raise
    if group is not None and hold():
        fsdp2_held_until_resharded(unit, lambda: _refill(freed))
    else:
        _refill(freed)


def _refill(freed: list[tuple[object, torch.Tensor, int]]) -> None:
    """Each freed shard's storage back, its rows copied from the gathered copy, the padding zero."""
    for param, whole, nbytes in freed:
        param._sharded_param_data.untyped_storage().resize_(nbytes)
        padded = param._sharded_param_data.view(param.padded_sharded_param_size)
        rows, length = padded.size(0), param.sharded_size[0]
        start = param.mesh_info.shard_mesh_rank * rows
        padded[:length].copy_(whole.data[start:start + length])
        padded[length:].zero_()
    freed.clear()


def fsdp2_held_until_resharded(unit: nn.Module, before: Callable[[], None] = lambda: None) -> None:
    """``unit``, gathered now (its ``unshard()`` done, its hooks in place), stays gathered through the forwards
    that follow, and their backward, until FSDP2 shards it again, whichever way: its post-backward, a
    ``reshard()``, FSDP2's own reset. ``before()`` runs just before that, while the gathered copy still exists;
    then the unit's ``reshard_after_forward`` is what it was, and the unit is FSDP2's as ever."""
    what = "FSDP2's param group (_to_sharded, _to_sharded_post_forward, post_forward_mesh_info)"
    need(unit, what, "_get_fsdp_state")
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is None:
        before()
        return
    need(group, what, "_to_sharded", "_to_sharded_post_forward", "post_forward_mesh_info", "is_unsharded")
    if not group.is_unsharded:
        raise PrivateAPIChanged(what, f"{type(unit).__name__} is not gathered: nothing to hold")
    after_forward = group.post_forward_mesh_info
    group.post_forward_mesh_info = None  # a forward leaves it gathered (FSDPParamGroup._reshard_after_forward)
    names = ("_to_sharded", "_to_sharded_post_forward")

    def released(name: str) -> Callable[[], None]:
        def to_sharded() -> None:
            for n in names:  # once: FSDP2's own methods from now on
                group.__dict__.pop(n, None)
            group.post_forward_mesh_info = after_forward
            before()
            getattr(group, name)()
        return to_sharded

    for name in names:
        setattr(group, name, released(name))
