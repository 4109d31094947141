"""FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=False``), sharded on the meta device.

Units come from ``uniform_requires_grad_policy``: one per decoder layer for the frozen weights, one
per untied embedding table, and one per all-trainable subtree (each ``lora_A`` / ``lora_B``, a
``modules_to_save`` copy), because a flat parameter has one ``requires_grad`` and one dtype. That also
keeps LoRA's fp32 weights out of a bf16 base's flat parameters, and frozen flat parameters get no
gradient at all.

Loading stays shard-only without FSDP1's state-dict machinery (its SHARDED_STATE_DICT all-gathers
every unit to build and to load the state dict): ``local_pieces`` describes, per original
parameter, the rectangles of it that lie in this rank's slice of a flat parameter, as a
``compat.ShardView`` whose pieces are views of that slice (a DTensor cannot: a flat range cuts
rows partway). ``dcp.load`` reads exactly those rectangles from the safetensors files, straight
into the flat parameter.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from shardtune.config import ConfigError
from shardtune.model.structure import embedding_tables
from shardtune.parallel.base import Strategy
from shardtune.parallel.mesh import data_parallel_mesh
from shardtune.parallel.wrap_policy import NonUniformModuleError, uniform_requires_grad_policy
from shardtune.runtime.compat import FlatLayout, ShardView, check_load_target_protocol, fsdp1_layout
from shardtune.runtime.distributed import Worker

_WRAPPED = "_fsdp_wrapped_module."

# One rectangle: its offsets in the full parameter and its sizes.
Box = tuple[tuple[int, ...], tuple[int, ...]]


def _clean(name: str) -> str:
    """The name without FSDP's wrapper parts: what peft and the checkpoint call it."""
    return name.replace(_WRAPPED, "").removesuffix(_WRAPPED.rstrip("."))


def boxes(start: int, end: int, shape: tuple[int, ...]) -> list[Box]:
    """Split elements ``[start, end)`` of a row-major tensor of ``shape`` into rectangles, in order.

    A rank's slice of a flat parameter is such a range of each parameter it touches; rectangles are
    what a checkpoint reader can read. A range cuts at most a partial row at each end per dimension.
    """
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)

    def in_row(row: int, a: int, b: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in boxes(a, b, shape[1:])]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = in_row(r0, c0, inner) if c0 else []
    first_full = r0 + 1 if c0 else r0
    if r1 > first_full:
        out.append(((first_full, *[0] * (len(shape) - 1)), (r1 - first_full, *shape[1:])))
    return out + (in_row(r1, 0, c1) if c1 else [])


class _MaterializeKeepingTies:
    """``param_init_fn``: allocate a module's meta parameters (uninitialised, like ``to_empty``).

    ``to_empty(recurse=False)`` per module would give each owner of a tied weight its own tensor;
    here every owner gets the same one. The policy has checked that owners share a unit.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                self.owners.setdefault(id(p), []).append((module, name))

    def __call__(self, module: nn.Module) -> None:
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
            for owner, attr in self.owners.get(id(p), [(module, name)]):
                owner._parameters[attr] = new


def _units(model: nn.Module) -> list[tuple[str, FSDP, FlatLayout]]:
    """Every FSDP unit that holds a flat parameter: its clean name, itself and its checked layout, in
    module order."""
    out = []
    for n, m in model.named_modules():
        if isinstance(m, FSDP) and (layout := fsdp1_layout(m)) is not None:
            out.append((_clean(n), m, layout))
    return out


def local_pieces(model: nn.Module) -> dict[str, ShardView]:
    """{peft parameter name: a load target whose pieces are views of this rank's flat slice}.

    Writing into the pieces writes the model. Tied aliases appear under their first name.
    """
    check_load_target_protocol()
    out: dict[str, ShardView] = {}
    for prefix, _, layout in _units(model):
        local = layout.flat.detach()  # outside forward/backward the data is this rank's padded slice
        start = layout.rank * layout.shard_numel
        for i, (fqn, shape) in enumerate(zip(layout.fqns, layout.shapes)):
            lo, hi = layout.local_range(i)
            pieces = []
            for offsets, sizes in boxes(lo, hi, tuple(shape)):
                at = layout.offsets[i] + _flat_index(offsets, shape) - start
                pieces.append((offsets, local[at:at + math.prod(sizes)].view(sizes)))
            name = f"{prefix}.{fqn}" if prefix else fqn
            out[name] = ShardView(shape, local.dtype, local.device, pieces)
    return out


def _flat_index(offsets: tuple[int, ...], shape: torch.Size) -> int:
    index = 0
    for o, n in zip(offsets, shape):
        index = index * n + o
    return index


def gather_full(model: nn.Module, names: list[str], grads: bool = False) -> dict[str, torch.Tensor]:
    """Full copies (on CPU) of the named parameters, or of their gradients; a collective.

    All-gathers only the units holding them, from the flat shards directly: no FSDP state changes,
    so it works before the first forward too. Missing gradients count as zeros.
    """
    where: dict[str, tuple[int, str]] = {}
    units = _units(model)
    for i, (prefix, _, layout) in enumerate(units):
        for fqn in [*layout.fqns, *layout.aliases]:
            where[f"{prefix}.{fqn}" if prefix else fqn] = (i, layout.aliases.get(fqn, fqn))
    unknown = [n for n in names if n not in where]
    if unknown:
        raise KeyError(f"not parameters of the FSDP1 model: {', '.join(unknown[:5])}")
    out: dict[str, torch.Tensor] = {}
    for i in sorted({where[n][0] for n in names}):  # the same order on every rank
        _, unit, layout = units[i]
        flat = layout.flat
        local = flat.grad if grads else flat.detach()
        local = torch.zeros_like(flat) if local is None else local
        # NCCL gathers only on the GPU, also when the shards are offloaded to the CPU
        local = local.to(unit.compute_device).contiguous()
        full = local.new_empty(local.numel() * layout.world_size)
        dist.all_gather_single(full, local, group=layout.process_group)
        tensors = {fqn: full[o:o + math.prod(shape)].view(shape)
                   for fqn, o, shape in zip(layout.fqns, layout.offsets, layout.shapes)}
        for n in names:
            if where[n][0] == i:
                out[n] = tensors[where[n][1]].to("cpu", copy=True)
    return out


class FSDP1(Strategy):
    name = "fsdp1"

    def __init__(self, worker: Worker, compute_dtype: torch.dtype, cpu_offload: bool,
                 replicate_groups: int = 1) -> None:
        super().__init__(worker)
        # HSDP: HYBRID_SHARD over the 2-D mesh (FSDP1 shards over dim 1, all-reduces over dim 0).
        self.mesh = data_parallel_mesh(worker, replicate_groups) if replicate_groups > 1 else None
        # As under FSDP2, LoRA's fp32 weights compute in the compute dtype, gradients are reduced in
        # fp32. Buffers keep the dtype they were built with (rotary inv_freq stays fp32, as in
        # from_pretrained). The policy already keeps fp32 and bf16 weights in separate flat params.
        # Every unit casts its inputs: peft casts x to ``lora_A.weight.dtype`` before calling lora_A,
        # and outside its unit's forward that attribute is the fp32 original, not the bf16 copy used.
        self.mp = MixedPrecision(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
        # On a CPU run the parameters are on the CPU already: offloading there would only add copies.
        self.offload = CPUOffload(offload_params=cpu_offload and worker.device.type != "cpu")
        self.load_targets = local_pieces

    def shard(self, model: nn.Module) -> nn.Module:
        embed, head, tied = embedding_tables(model)
        # Own units, so that FSDP1 materialises (and later gathers) one table at a time, not the
        # root with both tables while loading. Tied tables must stay in one unit: the root.
        tables = [] if tied else [m for m in (embed, head) if m is not None]
        try:
            policy = uniform_requires_grad_policy(model, own_units=tables)
        except NonUniformModuleError as err:
            raise ConfigError(f"--strategy fsdp1: {err} Here: --lora-bias none, or --strategy fsdp2.") from None
        return FSDP(
            model,
            auto_wrap_policy=policy,
            mixed_precision=self.mp,
            cpu_offload=self.offload,
            # also for "cpu": FSDP1 otherwise looks for an accelerator and refuses CPU-only runs
            device_id=self.worker.device,
            param_init_fn=_MaterializeKeepingTies(model, self.worker.device),
            sync_module_states=False,  # every rank reads its own shard from the checkpoint
            use_orig_params=False,
            limit_all_gathers=True,
            **({"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "device_mesh": self.mesh} if self.mesh else {}),
        )

    def gradient_sync(self, model: nn.Module, enabled: bool) -> ContextManager:
        # no_sync keeps unsharded gradients until the last micro-batch: only the LoRA flat
        # parameters have any, so that costs their (small) full size, not the model's.
        return contextlib.nullcontext() if enabled else model.no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The peft model, whose submodules are now FSDP units: its module names contain
        ``_fsdp_wrapped_module`` and its parameters are flat. Name-based peft helpers (adapter keys from
        ``get_peft_model_state_dict``) need the model as it was before ``shard``."""
        return model.module if isinstance(model, FSDP) else model

    def trainable(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable flat parameters (what the optimizer must hold), by their unit's clean name.

        Not peft names: a flat parameter is the concatenated shard of a whole unit; the peft names of
        what it holds are the ones ``model.trainable_names`` gave before sharding.
        """
        return {_clean(n): p for n, p in model.named_parameters() if p.requires_grad}

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        # FSDP1 sums the squared shard norms over ranks; with max_norm = inf the factor is exactly 1.
        return float(model.clip_grad_norm_(max_norm if max_norm > 0 else math.inf))

    def full_tensors(self, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        return gather_full(model, names)
