"""The ready model for a rank: built on meta, LoRA injected, parallelized, its shard loaded.

Used by the training recipe and by anything else that runs the model on N ranks (eval, tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.config import Config, ConfigError
from shardtune.model import quantize
from shardtune.model.directory import check_model_dir
from shardtune.model.loading import load, take_snapshot
from shardtune.model.lora import adapter_key_map, count_params, inject_lora, trainable_names
from shardtune.model.meta import DTYPES, build_meta_model
from shardtune.parallel import Strategy, choose_strategy, make_strategy, parallelize
from shardtune.runtime.distributed import Worker

log = logging.getLogger("shardtune")


@dataclass
class Built:
    model: nn.Module
    strategy: Strategy
    strategy_reason: str
    adapter_keys: dict[str, str]  # {key in the peft adapter file: trainable parameter name}
    total_params: int
    trainable_params: int


def build_model(cfg: Config, worker: Worker) -> Built:
    model_dir = check_model_dir(cfg.model.path)
    if cfg.model.quantize == "nf4":
        quantize.check_available()
    dtype = DTYPES[cfg.model.dtype]
    model = build_meta_model(model_dir, dtype)
    model, lora_init = inject_lora(model, cfg.lora, cfg.train.seed)
    # Named before sharding: FSDP1's wrappers hide the module names peft needs to name adapter tensors.
    adapter_keys = adapter_key_map(model, trainable_names(model))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable weights and their optimizer state stay fp32
    total, trainable = count_params(model)
    selection = None
    if cfg.model.quantize == "nf4":
        selection = quantize.select(model)
        quantize.warn_kept(selection)
    groups = cfg.parallel.replicate_groups
    if groups > 1 and cfg.parallel.strategy == "auto":
        name, why = "fsdp2", f"HSDP: sharded within each of {groups} replica groups"
    else:
        name, why = choose_strategy(cfg.parallel.strategy, worker, weight_bytes(model, dtype, selection),
                                    worker.local_world_size, cfg.parallel.cpu_offload)
    why = cfg.parallel.chosen or why  # decided before the workers started (choice.py)
    log.info("strategy %s: %s", name, why)
    if selection is not None:
        if name == "fsdp2":
            quantize.check_even_split(selection, worker.world_size // groups)
        elif name not in ("ddp", "single"):
            raise ConfigError(f"option 'quantize': nf4 is not supported with strategy {name}; use fsdp2")
        quantize.make_meta_nf4(selection)
    strategy = make_strategy(name, worker, dtype, cfg.parallel.cpu_offload, groups, cfg.parallel.fsdp_unit)
    snapshot = take_snapshot(model, lora_init)
    model = parallelize(
        model, strategy, lambda m, targets: load(m, model_dir, worker.device, snapshot, targets),
        cfg.parallel.activation_checkpointing,
    )
    return Built(model, strategy, why, adapter_keys, total, trainable)


def weight_bytes(model: nn.Module, dtype: torch.dtype, selection: quantize.Selection | None) -> int:
    """The base weights' size as stored: NF4 for the selected Linear weights, ``dtype`` for the rest."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) * dtype.itemsize
    for module in (selection.quantized.values() if selection else ()):
        rows, cols = module.weight.shape
        total += quantize.nf4_bytes(rows, cols, dtype.itemsize) - rows * cols * dtype.itemsize
    return total
