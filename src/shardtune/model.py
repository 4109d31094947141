"""The model before it is sharded: checked directory, meta-device build, LoRA injected and frozen.

Nothing here allocates base weights. Parameters live on the meta device; buffers (rotary
``inv_freq`` and the like) are real, because they are computed from the config and never stored in
the checkpoint. LoRA is injected here, before sharding, so that every parallel strategy sees the final
set of trainable parameters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtune.config import ConfigError, LoraConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ModelDirError(ConfigError):
    """The model directory is missing something a fine-tune needs."""


@dataclass
class ModelDir:
    path: Path
    weight_files: list[Path]
    index: dict | None

    @property
    def weight_names(self) -> set[str]:
        """Names of the tensors stored in the checkpoint (read from headers, not data)."""
        if self.index is not None:
            return set(self.index["weight_map"])
        from safetensors import safe_open

        names: set[str] = set()
        for file in self.weight_files:
            with safe_open(str(file), framework="pt") as f:
                names.update(f.keys())
        return names


def check_model_dir(path: str | Path) -> ModelDir:
    """Check a Hugging Face model directory and say exactly what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"model directory {path} has no config.json")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text())
            files = sorted({path / name for name in index["weight_map"].values()})
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelDirError(f"{index_file}: not a valid safetensors index ({err})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(f"{index_file} names weight files that are missing: {', '.join(missing)}")
        return ModelDir(path, files, index)
    if (path / "model.safetensors").is_file():
        return ModelDir(path, [path / "model.safetensors"], None)
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.gguf"))
    hint = f" (found {', '.join(others)}: convert to safetensors first)" if others else ""
    raise ModelDirError(
        f"model directory {path} has no model.safetensors or model.safetensors.index.json{hint}"
    )


def build_meta_model(model_dir: ModelDir, dtype: torch.dtype) -> nn.Module:
    """The causal LM from its config, weights on meta, tied weights tied as transformers ties them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir.path)
    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as err:
        raise ModelDirError(
            f"{model_dir.path / 'config.json'}: not a causal LM transformers can build ({err})"
        ) from None
    # accelerate re-creates every parameter registered under init_empty_weights, which undoes the
    # tying done in __init__: tie again now that registration is plain.
    model.tie_weights()
    model.config.use_cache = False
    return model


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def layer_classes(model: nn.Module) -> set[type]:
    """Classes of the repeated decoder blocks (transformers' ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    classes = layer_classes(model)
    return [m for m in model.modules() if type(m) in classes]


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
    from peft.tuners.tuners_utils import BaseTunerLayer

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
    )

    initial: dict[int, dict[str, torch.Tensor]] = {}
    move = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def record_then_move(self: BaseTunerLayer, adapter_name: str, device: torch.device | None = None) -> None:
        initial[id(self)] = {n: p.detach().float().clone() for n, p in self.named_parameters() if "lora_" in n}
        move(self, adapter_name, device)

    torch.manual_seed(seed)
    BaseTunerLayer._move_adapter_to_device_of_base_layer = record_then_move
    try:
        peft_model = get_peft_model(model, peft_config)
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    values = {}
    for module_name, module in peft_model.named_modules():
        for name, tensor in initial.get(id(module), {}).items():
            values[f"{module_name}.{name}"] = tensor
    missing = [n for n, p in peft_model.named_parameters() if "lora_" in n and n not in values]
    if missing:
        raise RuntimeError(f"LoRA initial values were not captured for {missing[:3]} (peft changed?)")
    return peft_model, values


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) counted once per tensor, also on meta and for tied weights."""
    seen: dict[int, tuple[int, bool]] = {}
    for p in model.parameters():
        seen[id(p)] = (math.prod(p.shape), p.requires_grad)
    return sum(n for n, _ in seen.values()), sum(n for n, t in seen.values() if t)


def embedding_tables(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None, bool]:
    """The input and output embedding modules, and whether they share their weight."""
    base = base_model(model)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    embed = embed if isinstance(embed, nn.Module) else None
    head = head if isinstance(head, nn.Module) else None
    if embed is None or head is None:
        return embed, head, False
    return embed, head, bool({id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()})
