"""Shard-only loading: allocate each rank's part of every parameter, then read just that part.

The order matters and lives here alone:
1. remember the real buffers and LoRA's initial values (they do not come from the checkpoint),
2. ``to_empty``: allocate the local shards (a full tensor only where the strategy replicates),
3. re-tie tied weights, put the buffers back,
4. read the base weights with torch.distributed.checkpoint's ``HuggingFaceStorageReader``, which
   reads from the safetensors files only the slices this rank's (possibly sharded) tensors cover
   (rank 0 shows a progress bar of the bytes read, and says how much when done),
5. write LoRA's initial values into the local shards, and DoRA's magnitudes (norms of the loaded rows),
6. fail loudly if anything is unmapped or still on meta.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardtune.model import nf4_fill
from shardtune.model.checkpoint_keys import map_checkpoint_keys, missing_error
from shardtune.model.directory import ModelDir, ModelDirError
from shardtune.model.finite import all_finite
from shardtune.model.structure import base_model
from shardtune.runtime.compat import ShardView, piece_boxes
from shardtune.runtime.logs import EVERY_RANK
from shardtune.runtime.memory import format_size
from shardtune.runtime.progress import Bar, progress
from shardtune.runtime.versions import tied_weights_keys

log = logging.getLogger("shardtune")

@dataclass
class Snapshot:
    """What ``to_empty`` would destroy and the checkpoint cannot give back."""

    buffers: dict[str, torch.Tensor]
    lora: dict[str, torch.Tensor]
    tied: dict[str, str]


def take_snapshot(model: nn.Module, lora_values: dict[str, torch.Tensor]) -> Snapshot:
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    base = base_model(model)
    tied = tied_weights_keys(base)
    return Snapshot(buffers=buffers, lora=lora_values, tied=tied)


def fill_from_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full tensor ``full`` into ``param``, which may be a shard (DTensor)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            # Every rank holds the same ``full``: slice locally, no communication.
            local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        elif isinstance(param, ShardView):
            # A strategy's own view of its shard (FSDP1: rectangles of a flat parameter's slice).
            for box, piece in piece_boxes(param):
                piece.copy_(full[box].to(piece.dtype))
        else:
            param.copy_(full.to(param.dtype))


def retie(model: nn.Module, snapshot: Snapshot) -> None:
    """``to_empty`` gives each module its own new tensor, so tied weights come apart: share again."""
    base = base_model(model)
    for target, source in snapshot.tied.items():
        shared = base.get_parameter(source)
        module_name, _, attr = target.rpartition(".")
        holder = base.get_submodule(module_name)
        # peft's modules_to_save wrapper: the tie is the frozen original's (the trained copy is free).
        holder = getattr(holder, "original_module", holder)
        if getattr(holder, attr) is not shared:
            setattr(holder, attr, shared)


def materialize(model: nn.Module, device: torch.device, snapshot: Snapshot,
                host_params: Callable[[nn.Module], set[int]] | None = None) -> None:
    """Allocate the (local shards of the) parameters and restore what is not in the checkpoint.

    ``host_params``: with CPU offload, gives the ids of the parameters that stay in host memory
    (FSDP2 refuses offloaded shards allocated on the GPU); the rest and the buffers go to ``device``.
    """
    if not any(p.is_meta for p in model.parameters()):
        return  # the strategy allocated its shards while sharding (FSDP1's param_init_fn); buffers untouched
    if host_params is None or device.type == "cpu":
        model.to_empty(device=device)
    else:
        model.to_empty(device="cpu")  # as torchtitan does for CPU offload
        on_host = host_params(model)
        with torch.no_grad():
            for module in model.modules():
                for name, p in module._parameters.items():
                    if p is not None and id(p) not in on_host:
                        module._parameters[name] = nn.Parameter(p.to(device), requires_grad=p.requires_grad)
                for name, b in module._buffers.items():
                    if b is not None:
                        module._buffers[name] = b.to(device)
    retie(model, snapshot)
    with torch.no_grad():
        for name, value in snapshot.buffers.items():
            model.get_buffer(name).copy_(value)


def load_base_weights(model: nn.Module, model_dir: ModelDir, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Read every non-LoRA tensor's local slice from the checkpoint; return unused checkpoint keys.

    ``tensors``: {peft parameter name: tensor to fill}, the parameters or a strategy's view of them.
    """
    stored = model_dir.weight_names
    lora_free = {n: t for n, t in tensors.items() if "lora_" not in n}
    four_bit = {}  # {checkpoint key: NF4 parameter}: read and quantized one at a time, after the rest
    plan: list[dict[str, torch.Tensor]] = []  # one dcp.load per round: a key may feed several parameters
    found, missing, used = map_checkpoint_keys(model, list(lora_free), stored)
    if missing:
        raise missing_error(model_dir, missing)
    for name, key in found.items():
        tensor = lora_free[name]
        if nf4_fill.is_nf4(tensor):
            four_bit[key] = tensor
        else:
            for round_ in plan:
                if key not in round_:
                    round_[key] = tensor.detach()
                    break
            else:
                plan.append({key: tensor.detach()})
    total = sum(_local_bytes(t) for round_ in plan for t in round_.values()) + \
        sum(_local_bytes(t) for t in four_bit.values())
    with progress("loading weights", total, unit="iB", summary=_loaded_line, unit_scale=True,
                  unit_divisor=1024) as bar:
        for round_ in plan:
            _check_shapes(round_, model_dir)
            dcp.load(round_, storage_reader=_counting_reader(str(model_dir.path), bar), no_dist=_one_process())
            _check_finite(round_, model_dir)
        _load_nf4(four_bit, model_dir, bar)
    return sorted(stored - used)


def _one_process() -> bool:
    """No process group (eval and generate on one device): DCP reads alone instead of warning that it does."""
    return not dist.is_initialized()


class _Counted:
    """A LoadPlanner seen through: each tensor the reader has filled advances the bar by its bytes."""

    def __init__(self, planner, bar: Bar) -> None:
        self._planner, self._bar = planner, bar

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        self._planner.commit_tensor(read_item, tensor)
        self._bar.advance(tensor.numel() * tensor.element_size())

    def __getattr__(self, name: str):
        return getattr(self._planner, name)


def _counting_reader(path: str, bar: Bar):
    """DCP's safetensors reader, counting what it reads into ``bar``: the same reads in the same one
    dcp.load, through the reader's public interface (``read_data`` commits each tensor it fills to the
    planner). Made here, not at import: versions.check_apis names a torch without the reader first."""
    return _counting_reader_class()(path, bar)


@functools.cache
def _counting_reader_class() -> type:
    class CountingReader(dcp.HuggingFaceStorageReader):
        def __init__(self, path: str, bar: Bar) -> None:
            super().__init__(path)
            self.bar = bar

        def read_data(self, plan, planner):
            return super().read_data(plan, _Counted(planner, self.bar))

    return CountingReader


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the part of ``tensor`` this rank holds: what reading it fills."""
    if isinstance(tensor, ShardView):
        return sum(piece.numel() * piece.element_size() for _, piece in piece_boxes(tensor))
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.dtype.itemsize


def _loaded_line(bar: Bar) -> str:
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    part = f" (rank 0's part; each of the {ranks} ranks reads its own)" if ranks > 1 else ""
    return f"loaded {format_size(bar.done)} of weights in {bar.seconds:.1f} s{part}"


def _load_nf4(params: dict[str, torch.Tensor], model_dir: ModelDir, bar: Bar) -> None:
    """Each NF4 weight: read this rank's slice in the compute dtype, quantize it, free it, next.

    So a rank never holds more than its 4-bit shard plus one bf16 slice. The slice is read through a
    plain tensor of the same placement (a DTensor when sharded), so DCP reads only its rows.
    """
    if params:
        _check_shapes(params, model_dir)
    for key, param in params.items():
        if isinstance(param, DTensor):
            local = param.to_local()
            rows = DTensor.from_local(torch.empty(local.shape, dtype=local.dtype, device=local.device),
                                      param.device_mesh, param.placements, run_check=False)
            group = _shard_group(param)
        else:
            rows, group = torch.empty(param.shape, dtype=param.dtype, device=param.device), None
        dcp.load({key: rows}, storage_reader=_counting_reader(str(model_dir.path), bar), no_dist=_one_process())
        nf4_fill.fill(param, rows.to_local() if isinstance(rows, DTensor) else rows, group)
        del rows


def _shard_group(param: DTensor) -> dist.ProcessGroup:
    """The ranks that hold the other rows of ``param``: its mesh's sharded dimension (HSDP's mesh is
    2-D, replicated over dim 0; the scaler mean is shared by the rows' holders, not the replicas)."""
    dims = [i for i, p in enumerate(param.placements) if p.is_shard()]
    if len(dims) != 1:
        raise RuntimeError(f"NF4 loading: expected one sharded mesh dimension, got placements {param.placements}")
    return param.device_mesh.get_group(dims[0])


def _check_finite(loaded: dict[str, torch.Tensor], model_dir: ModelDir) -> None:
    """A NaN/inf in a base weight, named here: found later it would read as a divergence blamed on --lr."""
    for key, tensor in loaded.items():
        if isinstance(tensor, ShardView):  # FSDP1: the view's pieces are the real tensors
            pieces = [piece for _, piece in piece_boxes(tensor)]
        else:
            pieces = [tensor.to_local() if isinstance(tensor, DTensor) else tensor]
        bad_pieces = [p for p in pieces if not all_finite(p)]
        if bad_pieces:
            bad = "NaN" if any(bool(torch.isnan(p).any()) for p in bad_pieces) else "inf"
            raise ModelDirError(f"{model_dir.path}: base weight {key} holds {bad} values (a damaged or wrongly "
                                f"converted checkpoint); training from it cannot work")


def _check_shapes(wanted: dict[str, torch.Tensor], model_dir: ModelDir) -> None:
    from safetensors import safe_open

    for file in model_dir.weight_files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    shape = list(f.get_slice(key).get_shape())
                    expected = list(wanted[key].shape)
                    if shape != expected:
                        raise ModelDirError(
                            f"{file}: tensor {key} has shape {shape}, but config.json gives {expected}"
                        )


def init_lora(tensors: dict[str, torch.Tensor], snapshot: Snapshot) -> None:
    for name, value in snapshot.lora.items():
        fill_from_full(tensors[name], value)


def init_dora_magnitudes(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """DoRA's magnitude: the L2 norm of each output row of W + scale·B@A, with B = 0 at init, so of W.

    peft computes it when the adapter is injected, from weights that are on meta then; here it comes
    from the loaded weights. FSDP2 shards a weight and its magnitude alike by rows (dim 0), so each
    rank's norms come from its own rows without communication. GPT-2's Conv1D stores W transposed:
    a row of W is then spread over ranks, so that weight is gathered, one at a time.
    """
    from shardtune.model.lora import is_dora_magnitude

    with torch.no_grad():
        for name, magnitude in tensors.items():
            if not is_dora_magnitude(name):
                continue
            module_name = name.split(".lora_magnitude_vector.", 1)[0]
            layer = model.get_submodule(module_name)
            weight = layer.get_base_layer().weight
            transposed = getattr(layer, "fan_in_fan_out", False)
            if not transposed and isinstance(weight, DTensor) and isinstance(magnitude, DTensor) \
                    and weight.placements == magnitude.placements:
                local = weight.to_local().float()
                magnitude.to_local().copy_(torch.linalg.norm(local, dim=1).to(magnitude.dtype))
                continue
            full = weight.full_tensor() if isinstance(weight, DTensor) else weight
            full = full.float().T if transposed else full.float()
            fill_from_full(magnitude, torch.linalg.norm(full, dim=1))


def assert_nothing_on_meta(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"still on the meta device after loading: {', '.join(left[:8])}")


class Placement(Protocol):
    """Where a strategy wants what loading fills (parallel/base.py's ``Strategy`` is one).

    ``load_targets`` maps the model to {parameter name: tensor to fill} when the strategy's view
    differs from the parameters (FSDP1: views into each flat parameter's local slice);
    ``host_params``: with CPU offload on a GPU, the ids of the parameters to allocate in host memory."""

    load_targets: Callable[[nn.Module], dict[str, torch.Tensor]] | None
    host_params: Callable[[nn.Module], set[int]] | None


def load(model: nn.Module, model_dir: ModelDir, device: torch.device, snapshot: Snapshot,
         placement: Placement | None = None) -> list[str]:
    """Steps 2–6 of the module docstring; returns checkpoint keys the model did not use.
    ``placement``: the strategy's (default: every parameter as it is, on ``device``)."""
    targets = placement.load_targets if placement is not None else None
    materialize(model, device, snapshot, placement.host_params if placement is not None else None)
    tensors = targets(model) if targets else dict(model.named_parameters())
    unused = load_base_weights(model, model_dir, tensors)
    init_lora(tensors, snapshot)
    # magnitudes given (--init-adapter) are kept; fresh ones are the loaded rows' norms
    init_dora_magnitudes(model, {n: t for n, t in tensors.items() if n not in snapshot.lora})
    assert_nothing_on_meta(model)
    if unused:
        log.warning("checkpoint tensors not used by the model: %s", ", ".join(unused[:8]), extra=EVERY_RANK)
    return unused
