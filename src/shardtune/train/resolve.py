"""``resolve``: the one function that decides a run's plan, from the configuration and this machine.

Every entry point calls it once: ``shardtune finetune`` and the Python API (in preflight, before any
worker starts), plain torchrun and ``python -m shardtune.train`` without a plan (rank 0, in
``recipe.run``, which hands its plan to every rank), and ``shardtune plan``. What ``plan`` refuses
is therefore what ``finetune`` refuses. Callers that start their own ranks (tests, benches) get the
plan of their ranks from ``resolve_on``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from torch import nn

from shardtune.config import Config, ConfigError
from shardtune.model import quantize
from shardtune.runplan import RunPlan, batch_split
from shardtune.runtime.device import backend, decide_dtype, planned_device_type
from shardtune.runtime.distributed import Worker
from shardtune.runtime.memory import MB, format_size
from shardtune.train.choice import (
    Candidate,
    NothingFits,
    Search,
    budget_of,
    choose,
    dequantizes_gathered_per_token,
    gathers_to_generate,
    generation_gathered,
    recompute_dequantized,
    recomputes_4bit,
    untiled,
)
from shardtune.train.longest import too_long

if TYPE_CHECKING:
    from shardtune.train.data.records import Lengths
    from shardtune.train.memory_model import Setting

log = logging.getLogger("shardtune")


def resolve(cfg: Config, lengths: Lengths | None = None, model: nn.Module | None = None,
            search: Search | None = None) -> tuple[Config, RunPlan | None, Candidate | None]:
    """(``cfg`` with nothing left on 'auto', its run plan, the automatic choice's candidate or None).

    ``cfg`` must have passed ``config.validate``. ``lengths``: the training data's record lengths, when
    known (the planner sizes a step's rows by them: ``choice.candidates``). ``model``: the LoRA model
    on meta, when the caller has built it (otherwise built here if a rule needs it). ``search``: the
    command's search over settings, when the caller reads it too (``shardtune plan``).
    The plan is None only when planning for GPUs from a machine without one with something left to
    choose: nothing measures the fit there (``shardtune plan`` still prints every prediction).
    Raises ConfigError (a BatchError for the batch arithmetic) naming the option at fault.
    """
    cfg = decide_dtype(cfg)
    if cfg.model.quantize == "nf4":
        quantize.check_available()
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    if "auto" not in (cfg.train.micro_batch_size, cfg.parallel.context_parallel):  # the error names the user's value
        batch_split(cfg, ranks)
    search = search or Search(cfg, lengths, model)
    try:
        cfg, chosen, why = choose(cfg, lengths, search)
    except NothingFits as refused:  # worded here, with the longest --seq-len that fits (train/longest.py)
        raise ConfigError(too_long(refused.cfg, search, refused.best, refused.budget, refused.where)) from None
    if cfg.parallel.strategy == "auto":
        return cfg, None, chosen
    kind = planned_device_type(cfg.parallel.device)
    plan = RunPlan.of(cfg, ranks, kind, backend(kind, cfg.parallel.cpu_offload), why)
    if cfg.model.quantize == "nf4":
        quantize.check_sharding(quantize.select(search.model), plan)
    return cfg, _settled(cfg, plan, search), chosen


def _settled(cfg: Config, plan: RunPlan, search: Search) -> RunPlan:
    """``plan`` with what is decided from the memory a rank may use once its strategy is (``choice.settled``).

    GRPO's generation (``choice.generation_gathered``): under FSDP2 on several ranks no layer gathered
    (``generation_exchanged``), else the weights kept for a whole generation when the predicted peak with them
    fits; a 4-bit base's weights dequantized once when that fits too (``generation_dequantized``); exchanged,
    training too where that moves fewer bytes (``layers_exchanged``). Then, under activation checkpointing, a
    4-bit base's recompute keeping each layer's dequantized weights for its backward where that fits too
    (``choice.recompute_dequantized``)."""
    setting = dataclasses.replace(
        search.setting(plan.strategy, plan.world_size, plan.batch.micro_batch_size),
        activation_checkpointing=plan.activation_checkpointing, cpu_offload=plan.cpu_offload,
        fsdp_unit=plan.fsdp_unit, mlp_tile=plan.mlp_tile, context_parallel=plan.context_parallel)
    budget, where = budget_of(cfg)
    if gathers_to_generate(setting):
        generated = generation_gathered(search, setting, budget)[0]
        if budget is not None:
            log.info("%s", _generation_said(search, setting, generated, budget, where))
        setting = generated
    chosen = recompute_dequantized(search, setting, budget)[0]
    if budget is not None and recomputes_4bit(search, chosen):
        log.info("%s", _recompute_said(search, chosen, budget, where))
    return dataclasses.replace(plan, generation_gathered=chosen.generation_gathered,
                               generation_dequantized=chosen.generation_dequantized,
                               generation_exchanged=chosen.generation_exchanged,
                               generation_replicated=chosen.generation_replicated,
                               generation_carried=chosen.generation_carried,
                               layers_exchanged=chosen.layers_exchanged,
                               recompute_dequantized=chosen.recompute_dequantized)


def _recompute_said(search: Search, chosen: Setting, limit: int, where: str) -> str:
    """The log line saying whether a layer's recompute keeps its 4-bit weights dequantized for its backward
    (``chosen``), with the predicted peak that decided it, against ``limit`` bytes per rank (from ``where``)."""
    kept = format_size(search.predict(dataclasses.replace(chosen, recompute_dequantized=True)).peak_mb * MB)
    budget = f"{format_size(limit)} per rank ({where})"
    if chosen.recompute_dequantized:
        return f"activation checkpointing: each layer's recompute keeps its 4-bit weights dequantized for its " \
               f"backward: predicted peak {kept} of {budget}"
    return f"activation checkpointing: each layer's backward dequantizes its 4-bit weights again (kept from its " \
           f"recompute, the predicted peak {kept} would exceed {budget})"


def _generation_said(search: Search, setting: Setting, chosen: Setting, limit: int, where: str) -> str:
    """The log line saying what generation keeps (``chosen``), with the predicted peaks that decided it, against
    ``limit`` bytes per rank (from ``where``)."""
    def peak(**kept: bool) -> str:
        return format_size(search.predict(dataclasses.replace(setting, **kept)).peak_mb * MB)

    budget = f"{format_size(limit)} per rank ({where})"

    if chosen.generation_exchanged:
        how = {"generation_exchanged": True, "layers_exchanged": chosen.layers_exchanged,
               "generation_replicated": chosen.generation_replicated}
        said = "generation and training compute from the row shards" if chosen.layers_exchanged else \
            "generation computes from the row shards"
        said, what = f"{said}, gathering no layer", "rows"
        if chosen.generation_replicated:
            said += ", every rank sampling all of its shard group's rows"
        if dequantizes_gathered_per_token(search, setting, limit):
            whole = peak(generation_gathered=True, generation_dequantized=True)
            said += f" (kept gathered, only the 4-bit weights fit, not dequantized ({whole}), and every token's " \
                    f"forward would dequantize them whole)"
    elif chosen.generation_gathered:
        how, said, what = {"generation_gathered": True}, "generation keeps the weights gathered", "ones"
        if chosen.generation_carried:
            how, said = {**how, "generation_carried": True}, f"{said}, and the training step after it too"
    else:
        return f"generation gathers the weights again for every token: kept gathered, the predicted peak " \
               f"{peak(generation_gathered=True)} exceeds {budget}"
    plain = peak(**how)
    if not search.facts.nf4_dequantized_bytes:
        return f"{said}: predicted peak {plain} of {budget}"
    once = peak(**how, generation_dequantized=True)
    if chosen.generation_dequantized:
        return f"{said}, the 4-bit {what} dequantized once: predicted peak {once} of {budget}"
    return f"{said}: predicted peak {plain} of {budget}; the 4-bit {what} are dequantized in every token's " \
           f"forward (dequantized once, the predicted peak {once} would exceed it)"


def resolve_on(worker: Worker, cfg: Config, batches: bool = True) -> RunPlan:
    """The run plan of ``cfg``, which must leave nothing to choose (``--dtype auto`` aside), on ``worker``'s
    ranks and device: ``resolve`` for callers that started their own ranks (tests, benches,
    ``recipe.prepare`` without a plan). ``batches=False``: for building a model, which makes no
    batches (any batch that splits over these ranks)."""
    cfg = decide_dtype(cfg)
    cfg = untiled(cfg)  # no budget to judge by
    if not batches:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=worker.world_size,
                                                                  micro_batch_size=None))
    kind = worker.device.type
    return RunPlan.of(cfg, worker.world_size, kind, backend(kind, cfg.parallel.cpu_offload))
