"""The ready model for a rank: built on meta, LoRA injected, parallelized, its shard loaded.

Used by the training recipe and by anything else that runs the model on N ranks (eval, tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from shardtune.config import Config
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
    dtype = DTYPES[cfg.model.dtype]
    model = build_meta_model(model_dir, dtype)
    model, lora_init = inject_lora(model, cfg.lora, cfg.train.seed)
    # Named before sharding: FSDP1's wrappers hide the module names peft needs to name adapter tensors.
    adapter_keys = adapter_key_map(model, trainable_names(model))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable weights and their optimizer state stay fp32
    total, trainable = count_params(model)
    groups = cfg.parallel.replicate_groups
    if groups > 1 and cfg.parallel.strategy == "auto":
        name, why = "fsdp2", f"HSDP: sharded within each of {groups} replica groups"
    else:
        name, why = choose_strategy(cfg.parallel.strategy, worker, total * dtype.itemsize, worker.local_world_size,
                                    cfg.parallel.cpu_offload)
    log.info("strategy %s: %s", name, why)
    strategy = make_strategy(name, worker, dtype, cfg.parallel.cpu_offload, groups)
    snapshot = take_snapshot(model, lora_init)
    model = parallelize(
        model, strategy, lambda m, targets: load(m, model_dir, worker.device, snapshot, targets, strategy.host_params),
        cfg.parallel.activation_checkpointing,
    )
    return Built(model, strategy, why, adapter_keys, total, trainable)
