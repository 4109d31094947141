"""The peft adapter a run produces: only the LoRA tensors are gathered, and the directory is written atomically,
with the base model's fingerprint in its metadata (what every command that meets a base checks:
model/adapter_dir.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardtune.model.adapter_dir import base_metadata
from shardtune.model.directory import ModelDir
from shardtune.model.fingerprint import model_fingerprint
from shardtune.model.hub import base_model_name
from shardtune.parallel import Strategy
from shardtune.runtime.files import staged_dir


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_adapter(tensors: dict[str, torch.Tensor], config: dict, out: Path, base: dict | None) -> Path:
    """Write a peft adapter directory (adapter_config.json + adapter_model.safetensors) atomically; ``base``:
    the fingerprint of the model it was trained on (None: unknown, a checkpoint of an older shardtune)."""
    from safetensors.torch import save_file

    with staged_dir(out) as tmp:
        weights = tmp / "adapter_model.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights), metadata=base_metadata(base))
        # safetensors writes through a private temporary file (0600): give it the mode the other files get
        weights.chmod(0o666 & ~_umask())
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def peft_config_dict(model: nn.Module, strategy: Strategy, base_model_path: str) -> dict:
    """What peft writes to adapter_config.json (its sets as sorted lists: the same file on every run)."""
    config = strategy.unwrap(model).peft_config["default"]
    config.base_model_name_or_path = base_model_name(base_model_path)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def save_adapter(
    model: nn.Module, strategy: Strategy, keys: dict[str, str], out: Path, base_model_path: str, model_dir: ModelDir,
    refuse: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """Write ``out`` (adapter_config.json + adapter_model.safetensors) on rank 0; a collective.

    ``keys``: {adapter file key: trainable parameter name}, from ``adapter_key_map`` before sharding.
    ``model_dir``: the base model, whose fingerprint the adapter records. ``refuse``: called on every rank with
    the whole adapter (the same on each) before anything is written; what it raises stops the write.
    """
    full = strategy.full_tensors(model, list(keys.values()))
    tensors = {k: full[n] for k, n in keys.items()}
    if refuse is not None:
        refuse(tensors)
    if strategy.worker.is_main:
        write_adapter(tensors, peft_config_dict(model, strategy, base_model_path), out, model_fingerprint(model_dir))
    dist.barrier()
    return out


def adapter_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
