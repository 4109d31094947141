"""LoRA on the meta model: injected and frozen before sharding, so every strategy sees the final trainable set.

peft creates and names the adapter; this module records its initial values (they do not come from the
checkpoint) and asks peft how it names adapter tensors in the saved file."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardtune.config import ConfigError, LoraConfig, validate_lora_init
from shardtune.model.lora_forward import fuse_lora_forward
from shardtune.runtime.compat import record_lora_init

#: What peft puts before a base model's parameter names (``PeftModel.base_model.model``).
PEFT_PREFIX = "base_model.model."


def _linear_names(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))})


def _split(names: str) -> list[str]:
    return [n.strip() for n in names.split(",") if n.strip()]


def inject_lora(model: nn.Module, lora: LoraConfig, seed: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Wrap ``model`` with peft LoRA on meta; return it and LoRA's initial values (fp32, full).

    peft creates each adapter on the CPU, initialises it with the global RNG and then moves it to the
    base layer's device (meta here). We record the values just before that move: they are exactly
    what ``get_peft_model`` gives for the same seed on a real model, and every rank computes the same.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    validate_lora_init(lora.init)
    targets: str | list[str] = lora.targets.strip()
    if targets != "all-linear":
        targets = _split(targets)
        available = _linear_names(model)
        unknown = [t for t in targets if t not in available]
        if unknown:
            raise ConfigError(
                f"option 'lora-targets': the model has no module named {', '.join(unknown)}; "
                f"its linear modules are: {', '.join(available)}"
            )
    modules_to_save = _split(lora.modules_to_save) or None
    if modules_to_save:
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        unknown = [m for m in modules_to_save if m not in names]
        if unknown:
            raise ConfigError(f"option 'lora-modules-to-save': the model has no module named {', '.join(unknown)}")
    peft_config = PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
        bias=lora.bias, modules_to_save=modules_to_save, task_type="CAUSAL_LM",
        use_dora=lora.variant == "dora", use_rslora=lora.rslora,
        init_lora_weights=True if lora.init == "default" else lora.init,
    )

    initial: dict[int, dict[str, torch.Tensor]] = {}

    def record(layer: nn.Module) -> None:
        initial[id(layer)] = {n: p.detach().float().clone() for n, p in layer.named_parameters() if "lora_" in n}

    torch.manual_seed(seed)
    with record_lora_init(record):
        peft_model = get_peft_model(model, peft_config)
    fuse_lora_forward(peft_model)
    values = {}
    for module_name, module in peft_model.named_modules():
        for name, tensor in initial.get(id(module), {}).items():
            values[f"{module_name}.{name}"] = tensor
    # DoRA's magnitude is the norm of each base weight row: loading computes it from the real shards.
    missing = [n for n, p in peft_model.named_parameters()
               if "lora_" in n and n not in values and not is_dora_magnitude(n)]
    if missing:
        raise RuntimeError(f"LoRA initial values were not captured for {missing[:3]} (peft changed?)")
    if lora.init_adapter:
        from shardtune.model.init_adapter import initial_values

        keys = adapter_key_map(peft_model, trainable_names(peft_model))
        values = initial_values(peft_model, values, lora.init_adapter, keys)
    return peft_model, values


def is_dora_magnitude(name: str) -> bool:
    return ".lora_magnitude_vector." in name


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) counted once per tensor, also on meta and for tied weights."""
    seen: dict[int, tuple[int, bool]] = {}
    for p in model.parameters():
        seen[id(p)] = (math.prod(p.shape), p.requires_grad)
    return sum(n for n, _ in seen.values()), sum(n for n, t in seen.values() if t)


def adapter_key_map(peft_model: nn.Module, names: list[str]) -> dict[str, str]:
    """{key in adapter_model.safetensors: trainable parameter name}, exactly as peft renames them.

    peft's renaming is asked rather than re-implemented: each name gets a tensor holding its own
    index, and the indices come back under peft's keys.
    """
    from peft import get_peft_model_state_dict

    tagged = {n: torch.tensor(i) for i, n in enumerate(names)}
    renamed = get_peft_model_state_dict(peft_model, state_dict=tagged, save_embedding_layers=False)
    if len(renamed) != len(names):
        # peft finds adapter tensors by module names: wrappers inside the tree (FSDP1 units) hide them.
        raise RuntimeError(f"peft recognised {len(renamed)} of the {len(names)} trainable tensors as adapter "
                              f"tensors of {type(peft_model).__name__}; pass the model with its original module names")
    return {key: names[int(index)] for key, index in renamed.items()}
