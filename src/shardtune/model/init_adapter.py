"""``--init-adapter DIR``: start from a trained peft adapter (e.g. the SFT stage's) instead of a fresh LoRA.

The adapter's tensors replace LoRA's initial values before loading, so every strategy writes them into
its shards exactly as it writes a fresh initialisation (adapters are small: each rank reads the file).
Checked against the LoRA options and the model before any worker starts: rank, alpha, target modules,
DoRA and rsLoRA must be those the run injects, and every tensor must be there with its shape; the
first that is not is named with both shapes (an adapter for another base ends there).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardtune.config import ConfigError
from shardtune.errors import ShardtuneError
from shardtune.model.adapter_dir import check_adapter_dir


class AdapterError(ShardtuneError, ValueError):
    """An --init-adapter that does not fit the model or the LoRA options; the message names the mismatch."""


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a peft adapter directory, with errors that name the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"option 'init-adapter': {root} is not a directory (expected a peft adapter directory "
                          f"with adapter_config.json and adapter_model.safetensors)")
    # the one adapter check (model/directory.py): what merge, export, generate and eval refuse, this refuses too
    config = check_adapter_dir(root, "option 'init-adapter': adapter directory")
    weights = root / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"option 'init-adapter': {weights} is missing")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as err:
        raise AdapterError(f"{weights}: not a readable safetensors file ({err}); a truncated copy?") from None
    return config, tensors


def initial_values(peft_model: nn.Module, fresh: dict[str, torch.Tensor], path: str | Path,
                   keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """LoRA's starting values from the adapter at ``path``, keyed like ``fresh`` (the fresh initial values);
    ``keys``: {key in the adapter file: trainable parameter name} (lora.adapter_key_map)."""
    config, stored = read_adapter(path)
    ours = peft_model.peft_config["default"]
    where = Path(path) / "adapter_config.json"
    expected = {"r": ours.r, "lora_alpha": ours.lora_alpha, "use_dora": bool(ours.use_dora),
                "use_rslora": bool(ours.use_rslora)}
    flags = {"r": "lora-r", "lora_alpha": "lora-alpha", "use_dora": "lora-variant", "use_rslora": "lora-rslora"}
    for key, want in expected.items():
        got = config.get(key, False if key.startswith("use_") else None)
        if got != want:
            raise AdapterError(f"{where}: {key} is {got!r} but this run's --{flags[key]} gives {want!r}; give the "
                               f"options the adapter was trained with")
    theirs = config.get("target_modules")
    theirs = set(theirs) if isinstance(theirs, list) else theirs
    if theirs != set(ours.target_modules) and theirs != ours.target_modules:
        raise AdapterError(f"{where}: target_modules {sorted(theirs) if isinstance(theirs, set) else theirs!r} "
                           f"differ from this run's --lora-targets ({', '.join(sorted(ours.target_modules))})")
    params = dict(peft_model.named_parameters())
    values = dict(fresh)
    weights = Path(path) / "adapter_model.safetensors"
    for key, name in keys.items():
        if key not in stored:
            raise AdapterError(f"{weights}: no tensor {key} (an adapter for another model, or other targets?)")
        if tuple(stored[key].shape) != tuple(params[name].shape):
            raise AdapterError(f"{weights}: {key} has shape {tuple(stored[key].shape)}, the model's "
                               f"{name} has {tuple(params[name].shape)} (an adapter for another base model?)")
        values[name] = stored[key].float()
    extra = sorted(set(stored) - set(keys))
    if extra:
        raise AdapterError(f"{weights}: {len(extra)} tensors this run would not train, e.g. {extra[0]} (other "
                           f"--lora-targets or --lora-modules-to-save?)")
    return values
