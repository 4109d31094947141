"""The ready model for a rank: built on meta, LoRA injected, parallelized, its shard loaded.

Used by the training recipe and by anything else that runs the model on N ranks (eval, tests).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from shardtune.config import Config, LoraConfig, ModelConfig, ParallelConfig, TrainConfig
from shardtune.model import quantize
from shardtune.model.attention import check_context_parallel
from shardtune.model.directory import ModelDir, check_model_dir
from shardtune.model.loading import load, take_snapshot
from shardtune.model.lora import adapter_key_map, count_params, inject_lora, trainable_names
from shardtune.model.meta import DTYPES, build_meta_model, compute_dtype
from shardtune.parallel import Strategy, make_strategy, parallelize
from shardtune.runplan import RunPlan
from shardtune.runtime import distributed
from shardtune.runtime.device import auto_dtype, backend
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


def build_model(cfg: Config, worker: Worker, plan: RunPlan) -> Built:
    """The model of ``plan`` (``resolve`` or ``resolve_on`` made it), built, sharded and loaded on this rank."""
    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    return _build(model_dir, None, cfg, worker, plan)


def _build(model_dir: ModelDir, meta_model: nn.Module | None, cfg: Config, worker: Worker, plan: RunPlan) -> Built:
    plan.check(cfg, worker.world_size, worker.device.type, batch=False)
    if cfg.model.quantize == "nf4":
        quantize.check_available()
    dtype = compute_dtype(cfg)
    model = meta_model if meta_model is not None else build_meta_model(model_dir, dtype)
    check_context_parallel(model, plan.context_parallel)  # before any weight is read
    model, lora_init = inject_lora(model, cfg.lora, cfg.train.seed)
    # Named before sharding: FSDP1's wrappers hide the module names peft needs to name adapter tensors.
    adapter_keys = adapter_key_map(model, trainable_names(model))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable weights and their optimizer state stay fp32
    total, trainable = count_params(model)
    if not plan.why:  # an automatic choice is said once, by rank 0 of the recipe (plan.why)
        log.info("strategy %s: requested", plan.strategy)
    if cfg.model.quantize == "nf4":
        selection = quantize.select(model)
        quantize.warn_kept(selection)
        quantize.check_sharding(selection, plan)
        quantize.make_meta_nf4(selection)
    strategy = make_strategy(plan, worker, dtype)
    snapshot = take_snapshot(model, lora_init)
    model = parallelize(
        model, strategy, lambda m: load(m, model_dir, worker.device, snapshot, strategy),
        plan.activation_checkpointing, plan.mlp_tile, plan.recompute_dequantized,
    )
    return Built(model, strategy, plan.why or "requested", adapter_keys, total, trainable)


def load_sharded(
    model: str | Path,
    lora: LoraConfig | dict[str, Any] | None = None,
    *,
    meta_model: nn.Module | None = None,
    dtype: str = "auto",
    seed: int = 0,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    trust_remote_code: bool = False,
) -> nn.Module:
    """An FSDP2-sharded peft LoRA model with its weights loaded, each rank reading only its shard.

    For your own FSDP2 training loop. Call it on every rank after ``torch.distributed`` is set up
    (torchrun + ``init_process_group``; without a process group a one-process group is made).

    Args:
        model: a Hugging Face model directory or Hub id (``org/name[@revision]``, see ``--model``);
            the weights are read from its safetensors files.
        lora: a :class:`shardtune.config.LoraConfig` or a dict of its fields (``r``, ``alpha``,
            ``dropout``, ``targets``, ``bias``, ``modules_to_save``, ``variant`` ("lora" or "dora"),
            ``rslora``, ``init``); default: ``LoraConfig()``.
        meta_model: a plain (not peft) transformers model built on the meta device from the same
            config, e.g. with your own changes; default: built from ``model``'s config.json.
        dtype: "bf16", "fp32" or "auto" (as ``--dtype auto``: bf16 where the device computes in it
            natively, else fp32 on CPUs, fp16 on older GPUs): frozen base weights and compute. LoRA
            weights are fp32.
        seed: LoRA's initial values; the same on every rank and equal to ``get_peft_model`` after
            ``torch.manual_seed(seed)`` on a full model.
        activation_checkpointing, cpu_offload: as the fine-tune options of the same names.
        trust_remote_code: allow a model whose config names its own code.

    Returns:
        The peft model, sharded with ``fully_shard`` per decoder-layer part and at the root. Its
        trainable parameters (``requires_grad``) are the LoRA weights, as DTensors: give them to any
        optimizer; ``torch.nn.utils.clip_grad_norm_`` works on them.

    Every rank must call the model's forward (and backward) the same number of times, also in
    evaluation: FSDP2 all-gathers each unit's weights, and the frozen embedding tables are row-
    sharded (each rank keeps a slice of the vocabulary), so looking up tokens and computing logits
    run collectives. A rank with no data of its own should run a dummy batch.
    """
    import torch.distributed as dist

    from shardtune.config import ConfigError

    if isinstance(lora, dict):
        known = {f.name for f in dataclasses.fields(LoraConfig)}
        unknown = sorted(set(lora) - known)
        if unknown:
            raise ConfigError(f"load_sharded: unknown LoRA option(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        lora = LoraConfig(**lora)
    lora = lora or LoraConfig()
    if dtype not in ("auto", *DTYPES):
        raise ConfigError(f"load_sharded: dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    # --cpu-offload on CUDA: NCCL for the GPU tensors and gloo for the offloaded CPU ones (clipping's norm)
    worker = distributed.init_worker(cpu_offload=cpu_offload)
    if dtype == "auto":
        dtype = auto_dtype(worker.device.type)
    if dist.get_world_size() != worker.world_size:  # a process group the caller set up without env
        worker = dataclasses.replace(worker, rank=dist.get_rank(), world_size=dist.get_world_size())
    model_dir = check_model_dir(model, trust_remote_code)
    # a model to train in the caller's own loop: FSDP2 on the ranks of the process group, no batches of ours
    cfg = Config(model=ModelConfig(path=str(model), dtype=dtype, trust_remote_code=trust_remote_code),
                 lora=lora, train=TrainConfig(seed=seed, batch_size=worker.world_size),
                 parallel=ParallelConfig(strategy="fsdp2", activation_checkpointing=activation_checkpointing,
                                         cpu_offload=cpu_offload, mlp_tile=None))
    kind = worker.device.type
    plan = RunPlan.of(cfg, worker.world_size, kind, backend(kind, cpu_offload))
    return _build(model_dir, meta_model, cfg, worker, plan).model
