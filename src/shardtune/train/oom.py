"""Running out of memory, said as what it is: the stage, the planned peak, and the flags that need less.

torch raises ``torch.OutOfMemoryError`` when the caching allocator cannot get a block from the GPU.
Left alone it ended a run as an unforeseen crash (exit 3, "most likely a bug"); it is a setting that
does not fit this GPU, so it ends as a ``ShardtuneError`` (exit 2) that names the stage, the peak the
planner predicted for the run's setting against the memory per rank, and the settings the planner
predicts to need less (from the same model facts ``shardtune plan`` uses, computed once, after the
fact: the fake-tensor pass allocates nothing on the GPU).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from shardtune.config import Config, ConfigError, combination_refusal, parse_size, traits, unit_of
from shardtune.errors import ShardtuneError
from shardtune.model.footprint import model_facts
from shardtune.runplan import BatchSplit, RunPlan
from shardtune.runtime.budget import GPU_MARGIN, memory_per_rank
from shardtune.runtime.memory import MB, format_size
from shardtune.train.memory_model import Setting, predict
from shardtune.train.objectives import objective_of

log = logging.getLogger("shardtune")


class OutOfMemory(ShardtuneError, RuntimeError):
    """The run's setting needs more memory than this device has; the message says what needs less."""


def out_of_memory(err: BaseException, stage: str | None, cfg: Config, plan: RunPlan, rank: int,
                  local_ranks: int) -> OutOfMemory:
    """The error to raise for ``err`` (a ``torch.OutOfMemoryError``) in ``stage`` of the run of ``plan``."""
    device = torch.device(plan.device)
    what = "GPU memory" if device.type == "cuda" else "memory"
    where = f" in stage '{stage}'" if stage else ""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    head = f"rank {rank} ran out of {what}{where} (torch: {first})"
    try:
        advice = _advice(cfg, plan, device, local_ranks)
    except Exception as failed:  # the advice is a courtesy: it must never hide the error itself
        log.debug("no memory advice: %s", failed)
        advice = "`shardtune plan` with the same flags shows what each setting is predicted to need"
    return OutOfMemory(f"{head}. {advice}")


def _budget(cfg: Config, device: torch.device, local_ranks: int) -> tuple[int, str]:
    if cfg.parallel.memory_per_rank:
        return parse_size(cfg.parallel.memory_per_rank), f"--memory-per-rank {cfg.parallel.memory_per_rank}"
    if device.type == "cuda":  # what this process holds now makes the free memory meaningless: the total
        total = torch.cuda.get_device_properties(device).total_memory
        return int((1 - GPU_MARGIN) * total), f"the GPU's {format_size(total)} less a {GPU_MARGIN:.0%} margin"
    return memory_per_rank(device, local_ranks)


def _variants(cfg: Config, plan: RunPlan) -> list[tuple[str, Config, RunPlan]]:
    """(the flag, its config, its plan) for each change of the run's setting that needs less memory."""
    out = []

    def changed(flag: str, strategy: str | None = None, micro: int | None = None, **parallel) -> None:
        new = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))
        name = strategy or plan.strategy
        if combination_refusal(new, name, plan.world_size) is not None:
            return
        cp = new.parallel.context_parallel
        try:
            batch = BatchSplit.of(plan.batch.batch_size, micro or plan.batch.micro_batch_size,
                                   plan.world_size // cp, plan.batch.packing, cp)
        except ConfigError:
            return
        out.append((flag, new, dataclasses.replace(
            plan, strategy=name, batch=batch, cpu_offload=new.parallel.cpu_offload, context_parallel=cp,
            activation_checkpointing=new.parallel.activation_checkpointing,
            fsdp_unit=plan.fsdp_unit if name == plan.strategy else unit_of(name, "auto"))))

    if not plan.activation_checkpointing:
        changed("--activation-checkpointing", activation_checkpointing=True)
    micro = plan.batch.micro_batch_size
    if micro > 1:
        changed(f"--micro-batch-size {micro // 2}", micro=micro // 2)
    if plan.device == "cuda" and traits(plan.strategy).cpu_offload and not plan.cpu_offload:
        changed("--cpu-offload", cpu_offload=True)
    if not traits(plan.strategy).shards and plan.world_size > 1:
        changed("--strategy fsdp2", strategy="fsdp2")
    if traits(plan.strategy).context_parallel and plan.world_size >= 2 * plan.context_parallel:
        changed(f"--context-parallel {2 * plan.context_parallel}", context_parallel=2 * plan.context_parallel)
    return out


def _peak_mb(facts, cfg: Config, plan: RunPlan, device: torch.device) -> float:
    rows = objective_of(cfg).rows_per_forward(plan.batch.micro_batch_size)
    setting = Setting(plan.strategy, plan.world_size, rows, plan.seq_len, plan.activation_checkpointing,
                      plan.cpu_offload, plan.replicate_groups, plan.fsdp_unit, plan.context_parallel)
    return predict(facts, setting, device.type).peak_mb


def _advice(cfg: Config, plan: RunPlan, device: torch.device, local_ranks: int) -> str:
    variants = _variants(cfg, plan)
    facts = model_facts(cfg, device, plan.seq_len)  # each micro-batch size traced when first asked for
    budget, source = _budget(cfg, device, local_ranks)
    planned = _peak_mb(facts, cfg, plan, device)
    setting = (f"{plan.strategy}, micro-batch {plan.batch.micro_batch_size}, activation checkpointing "
               f"{'on' if plan.activation_checkpointing else 'off'}{', CPU offload' if plan.cpu_offload else ''}")
    text = (f"The planner predicted a peak of {format_size(planned * MB)} per rank for this setting ({setting}; "
            f"rows of --seq-len {plan.seq_len}) against {format_size(budget)} per rank ({source})")
    less = sorted(((_peak_mb(facts, c, p, device), flag) for flag, c, p in variants), key=lambda v: v[0])
    less = [(mb, flag) for mb, flag in less if mb < planned]
    if not less:
        return text + "; no single flag is predicted to need less: a smaller --seq-len or more ranks would"
    fitting = [f"{flag} ({format_size(mb * MB)})" for mb, flag in less if mb * MB <= budget]
    other = [f"{flag} ({format_size(mb * MB)})" for mb, flag in less if mb * MB > budget]
    said = f"; predicted to fit: {', '.join(fitting)}" if fitting else ""
    if other:
        said += f"; {'also ' if fitting else ''}less but not enough: {', '.join(other)}"
    return text + said + " (`shardtune plan` with the same flags shows every term)"
