"""What a causal LM is made of, as every strategy and the planner must agree on it: its decoder
layers, the parts of a layer that become FSDP units, and its embedding tables."""

from __future__ import annotations

from torch import nn


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def layer_classes(model: nn.Module) -> set[type]:
    """The repeated decoder-block classes: the one definition FSDP1, FSDP2, the planner and the
    benchmarks' peers share, so that they never disagree on what a layer is.

    Hugging Face's ``_no_split_modules`` (of any module in the tree, so a peft wrapper works too) where
    the model has it; otherwise the element class of every outermost ``ModuleList`` of two or more
    same-class blocks with parameters (``layers``, ``h``, ``blocks`` …).
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(type(module), "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if classes:
        return classes

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if (
            isinstance(module, nn.ModuleList) and len(children) > 1
            and len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters())
        ):
            classes.add(type(children[0]))
            return
        for child in children:
            visit(child)

    visit(model)
    return classes


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    classes = layer_classes(model)
    return [m for m in model.modules() if type(m) in classes]


def embedding_tables(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None, bool]:
    """The input and output embedding modules, and whether they share their weight."""
    base = base_model(model)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    embed = embed if isinstance(embed, nn.Module) else None
    head = head if isinstance(head, nn.Module) else None
    if embed is None or head is None:
        return embed, head, False
    return embed, head, bool({id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()})


def layer_parts(layer: nn.Module) -> list[nn.Module]:
    """FSDP units for one decoder layer, innermost first, the layer itself (its norms) last.

    Backward holds the unit computing and the one prefetched, and each gather briefly holds its unit
    twice (buffer, then copy-out). So a container (attention, MLP) holding more than a quarter of the
    layer is split into its children; a child holding under 1/16 of the layer (a norm) stays with its
    parent instead of costing a collective of its own. Modules that own parameters directly, and
    peft's LoRA layers (base layer plus adapters), are never split. Containers (``ModuleList``,
    ``ModuleDict``) are never units, because FSDP gathers a unit in its forward and theirs never runs:
    what they hold stays with their parent.
    """
    total = sum(p.numel() for p in layer.parameters())

    def size(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    def split(module: nn.Module) -> list[nn.Module]:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return []
        children = [c for c in module.children() if size(c) * 16 >= total]
        if (size(module) * 4 <= total and module is not layer) or len(children) < 2 \
                or any(True for _ in module.parameters(recurse=False)) or hasattr(module, "base_layer"):
            return [module]
        units = [unit for child in children for unit in split(child)]
        inside = {id(p) for unit in units for p in unit.parameters()}
        left = any(id(p) not in inside for p in module.parameters())  # e.g. the layer's norms
        return units + [module] if left or module is layer else units

    return split(layer)


def tables_by_rows(embed: nn.Module | None, head: nn.Module | None, tied: bool) -> dict[str, bool]:
    """Which embedding tables (``model.embedding_tables``) FSDP2 uses from row shards
    (sharded_embeddings.py): {"embed": …, "head": …}."""
    by_rows = {"embed": embedding_eligible(embed), "head": head_eligible(head)}
    return {k: v and (not tied or all(by_rows.values())) for k, v in by_rows.items()}


def head_eligible(head: nn.Module | None) -> bool:
    """A plain frozen ``nn.Linear`` without bias: not adapted by LoRA, not in ``modules_to_save``."""
    return type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad


def embedding_eligible(embed: nn.Module | None) -> bool:
    """A plain frozen ``nn.Embedding`` (subclasses such as Gemma's scaled one change the lookup)."""
    return (type(embed) is nn.Embedding and embed.max_norm is None and not embed.sparse
            and not embed.weight.requires_grad)


#: the attribute under which decoder layers of transformers' models keep their MLP
MLP_NAMES = ("mlp", "feed_forward", "ffn")


def mlp_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's MLP (what parallel/tiling.py tiles), or None when it has none by a known name."""
    for name in MLP_NAMES:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return module
    return None
