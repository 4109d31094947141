"""An FSDP1 auto-wrap policy that never puts frozen and trainable parameters in one flat parameter.

FSDP1 with ``use_orig_params=False`` flattens the parameters each unit owns (those not inside a
nested unit) into one ``FlatParameter``, which has a single ``requires_grad`` and dtype. A LoRA
model breaks the usual "one unit per decoder layer" policy: peft puts the trainable ``lora_A`` /
``lora_B`` next to the frozen ``base_layer`` inside the layer, and FSDP1 fails with
``Must flatten tensors with uniform requires_grad``.

``uniform_requires_grad_policy`` needs no class names and no peft import. It walks the module tree
once and makes a unit of

* every repeated block (``_no_split_modules``, or detected), so that frozen weights are gathered a
  layer at a time,
* every largest subtree whose parameters are all trainable (peft's ``lora_A.default`` Linear, a
  ``modules_to_save`` copy, a norm the user unfroze), so that the layer's unit keeps only frozen weights,
* any module whose own parameters differ in kind (``requires_grad``, dtype) from the unit it would
  otherwise join, and the root.

Only modules that run a forward can be units (FSDP1 gathers a unit in its forward), so containers
(``ModuleDict`` and the like) are looked through. Likewise a trainable module whose weights another
module reads directly, without calling it (peft's DoRA reads ``lora_A.weight``), is not supported.

A module whose *own* parameters differ in kind (a Linear with a frozen weight and a trainable bias:
peft's ``bias="all"`` / ``"lora_only"``) cannot be split between units: FSDP1 swaps a module's
parameters as a whole. The policy then raises ``NonUniformModuleError`` naming the modules, before
anything is allocated. (Moving such a bias into a child module would rename it in the checkpoint and
in the adapter, and an all-gathered bias would be freed before the parent's forward uses it.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp.wrap import CustomPolicy

from shardtune.errors import ShardtuneError
from shardtune.model import structure

__all__ = ["NonUniformModuleError", "wrap_units", "uniform_requires_grad_policy"]

# What one flat parameter must share.
Kind = tuple[bool, torch.dtype]
# Never called, so never a unit: FSDP1 gathers a unit's parameters in the unit's forward, and peft
# calls ``self.lora_A[name](x)``, the Linear inside the ModuleDict. A container's own parameters
# (peft's ParameterDicts) belong to the module holding it, which does run a forward.
_CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)


class NonUniformModuleError(ShardtuneError, ValueError):
    """A module owns parameters of different kinds itself, so no FSDP1 unit can hold them all."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _looked_through(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and the containers below it, down to the next modules that run a forward."""
    yield prefix.rstrip("."), module
    for name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            yield from _looked_through(child, f"{prefix}{name}.")


def _called_children(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The nearest modules below ``module`` that run a forward (containers looked through), in order."""
    for name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            yield from _called_children(child, f"{prefix}{name}.")
        else:
            yield prefix + name, child


def _own_kinds(module: nn.Module) -> dict[Kind, list[str]]:
    """The parameters ``module`` owns, counting those of containers below it, by kind."""
    kinds: dict[Kind, list[str]] = {}
    for prefix, holder in _looked_through(module):
        for name, p in holder.named_parameters(recurse=False):
            kinds.setdefault((p.requires_grad, p.dtype), []).append(f"{prefix}.{name}" if prefix else name)
    return kinds


def _describe(name: str, module: nn.Module, kinds: dict[Kind, list[str]]) -> str:
    parts = [
        f"{'trainable' if grad else 'frozen'} {_dtype_name(dtype)} {names}" for (grad, dtype), names in kinds.items()
    ]
    return f"{name or '<root>'} ({type(module).__name__}): " + ", ".join(parts)


def wrap_units(model: nn.Module, layer_classes: Iterable[type] | None = None,
               own_units: Iterable[nn.Module] = ()) -> dict[str, nn.Module]:
    """The modules to wrap, by name (``""``: the root), such that every unit's own parameters share one kind.

    ``own_units``: modules that get a unit of their own besides the blocks (large embedding tables,
    which in the root would be gathered whole at once with everything else the root holds).

    Raises ``NonUniformModuleError`` for modules whose own parameters differ in kind, and for tied
    parameters whose owners would land in different units (FSDP1 flattens a tensor only once).
    """
    classes = set(layer_classes) if layer_classes is not None else structure.layer_classes(model)
    extra = {id(m) for m in own_units}
    # Kinds in each module's whole subtree, to find the largest all-trainable subtrees.
    subtree: dict[nn.Module, set[Kind]] = {}

    def collect(module: nn.Module) -> set[Kind]:
        if module not in subtree:
            kinds = set(_own_kinds(module))
            for child in module.children():
                kinds |= collect(child)
            subtree[module] = kinds
        return subtree[module]

    collect(model)
    units: dict[str, nn.Module] = {"": model}
    unit_of: dict[nn.Module, str] = {}
    mixed: list[str] = []

    def visit(name: str, module: nn.Module, unit: str, unit_kind: list[Kind | None]) -> None:
        if module in unit_of:  # a module shared by two parents is wrapped (or not) once
            return
        kinds = _own_kinds(module)
        if len(kinds) > 1:
            mixed.append(_describe(name, module, kinds))
        own = next(iter(kinds)) if len(kinds) == 1 else None
        whole = next(iter(subtree[module])) if len(subtree[module]) == 1 else None
        if module is not model:
            # Trainable weights get their own unit even when the enclosing unit is still empty, so
            # that it gathers its frozen weights in one piece and gives them no gradient.
            if whole is not None and whole[0] and unit_kind[0] != whole:
                units[name] = module
                unit, unit_kind = name, [whole]
            elif type(module) in classes or id(module) in extra or (
                own is not None and unit_kind[0] != own and (own[0] or unit_kind[0] is not None)
            ):
                units[name] = module
                unit, unit_kind = name, [None]
        if own is not None and unit_kind[0] is None:
            unit_kind[0] = own
        for _, holder in _looked_through(module):
            unit_of[holder] = unit
        for child_name, child in _called_children(module):
            visit(f"{name}.{child_name}" if name else child_name, child, unit, unit_kind)

    visit("", model, "", [None])
    if mixed:
        raise NonUniformModuleError(
            "FSDP1 (use_orig_params=False) cannot shard these modules: each owns parameters of different "
            "kinds, but one FSDP unit flattens all of a module's own parameters into a single tensor with "
            "one requires_grad and one dtype. " + "; ".join(mixed[:6]) + (" …" if len(mixed) > 6 else "")
            + ". Freeze or unfreeze (and cast) each module's parameters together, e.g. peft bias='none', or "
            "use FSDP2 (fully_shard) or use_orig_params=True."
        )
    _check_tied(model, unit_of)
    return units


def _check_tied(model: nn.Module, unit_of: dict[nn.Module, str]) -> None:
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((f"{name}.{pname}" if name else pname, module))
    for names in owners.values():
        units = {unit_of[m] for _, m in names}
        if len(units) > 1:
            raise ValueError(
                f"tied parameter {', '.join(n for n, _ in names)} would be split over the FSDP units "
                f"{', '.join(repr(u or '<root>') for u in sorted(units))}; FSDP1 can flatten it into one only"
            )


def uniform_requires_grad_policy(model: nn.Module, layer_classes: Iterable[type] | None = None,
                                 own_units: Iterable[nn.Module] = ()) -> CustomPolicy:
    """An ``auto_wrap_policy`` for ``FullyShardedDataParallel(model, ...)`` whose units are each uniform.

    Built for this ``model`` (pass the same module to FSDP). ``layer_classes``: the blocks to gather one
    at a time; ``structure.layer_classes`` when not given.
    ``own_units``: further modules to wrap on their own (e.g. untied input and output embeddings).
    Raises ``NonUniformModuleError`` (a ``ValueError``) when no uniform split exists.
    """
    # Identity, not equality: the same class may occur in and out of a unit.
    targets = {id(m) for m in wrap_units(model, layer_classes, own_units).values()}
    return CustomPolicy(lambda module: id(module) in targets)
