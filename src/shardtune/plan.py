"""``shardtune plan``: what ``finetune`` would run for these flags, and each rank's predicted peak
memory per strategy, before any weight is read.

The run plan comes from ``resolve`` (train/resolve.py), the same function ``finetune`` uses, so the
two refuse the same flags. The predictions come from the memory model (train/memory_model.py);
this module lays them out: one row per strategy and flag combination, as a table or as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any

from shardtune.config import Config, build_config, combination_refusal, validate
from shardtune.model.footprint import model_facts
from shardtune.model.meta import compute_dtype
from shardtune.runplan import BatchError, BatchPlan, RunPlan
from shardtune.runtime.memory import MB, format_size
from shardtune.train.choice import budget_of
from shardtune.train.data.records import Lengths
from shardtune.train.memory_model import (
    STRATEGIES,
    TERMS,
    Prediction,
    default_memory_per_rank,
    plan_device,
    predict,
    row_tokens,
)
from shardtune.train.objectives import objective_of
from shardtune.train.resolve import resolve
from shardtune.train.training_data import training_lengths


def plan(cfg: Config, memory_per_rank: int | None = None, run: RunPlan | None = None,
         lengths: Lengths | None = None) -> dict[str, list[Prediction]]:
    """{strategy: predictions}; the first of each is for the configured checkpointing/offload flags,
    the others vary them. A row that cannot run says why in its note, in the words of the rule that
    refuses it (``config.combination_refusal``, ``BatchPlan.make``); ``run``: the plan ``finetune``
    would run, whose row is marked (``Prediction.runs``); ``lengths``: the training data's, which size
    a step's rows (``memory_model.row_tokens``). Single is shown on one rank."""
    device, traced = plan_device(cfg.parallel.device)
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    budget = memory_per_rank or default_memory_per_rank(cfg.parallel.nproc, device)
    batches: dict[str, BatchPlan | str] = {}
    for strategy in STRATEGIES:
        try:
            batches[strategy] = BatchPlan.make(cfg.train.batch_size, cfg.train.micro_batch_size,
                                               1 if strategy == "single" else ranks, cfg.data.packing)
        except BatchError as err:
            batches[strategy] = str(err)
    micros = {b.micro_batch_size for b in batches.values() if isinstance(b, BatchPlan)}
    if not micros:
        raise BatchError(next(iter(batches.values())))  # type: ignore[arg-type]
    width = row_tokens(cfg, lengths)
    rows = {objective_of(cfg).rows_per_forward(m) for m in micros}
    facts = model_facts(cfg, rows, {compute_dtype(cfg)}, traced, width)
    out: dict[str, list[Prediction]] = {}
    for strategy in STRATEGIES:
        batch = batches[strategy]
        world = 1 if strategy == "single" else ranks
        given = (cfg.parallel.activation_checkpointing, cfg.parallel.cpu_offload)
        offloads = (False, True) if strategy in ("fsdp2", "fsdp1") else (False,)
        flags = [given] + [(ac, off) for ac in (False, True) for off in offloads if (ac, off) != given]
        preds = []
        for ac, off in flags:
            flagged = dataclasses.replace(cfg, parallel=dataclasses.replace(
                cfg.parallel, activation_checkpointing=ac, cpu_offload=off))
            refused = batch if isinstance(batch, str) else combination_refusal(flagged, strategy, world)
            if refused:
                preds.append(Prediction(strategy, world, ac, off, {}, "", note=refused))
                continue
            unit = "part" if cfg.parallel.fsdp_unit == "auto" else cfg.parallel.fsdp_unit
            p = predict(facts, strategy, world, objective_of(cfg).rows_per_forward(batch.micro_batch_size), width,
                        ac, off, device, cfg.parallel.replicate_groups, unit)
            p.fits = None if budget is None else p.peak_mb * MB <= budget
            p.runs = run is not None and (run.strategy, run.activation_checkpointing, run.cpu_offload) == \
                (strategy, ac, off)
            preds.append(p)
        if all(not p.terms for p in preds) and len({p.note for p in preds}) == 1:
            preds = preds[:1]  # one reason for every row of the strategy: said once
        out[strategy] = preds
    return out


# --- what `shardtune plan` prints ------------------------------------------------------------

_SHORT = {"activations": "activ", "optimizer": "optim"}


def as_json(predictions: dict[str, list[Prediction]]) -> dict[str, Any]:
    """{strategy: the prediction for the flags given, with the other flag combinations as "variants"}."""
    out = {}
    for strategy, (first, *others) in predictions.items():
        out[strategy] = {**first.as_dict(), "variants": [p.as_dict() for p in others]}
    return out


def _fits(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _on(value: bool) -> str:
    return "yes" if value else "no"


def render(predictions: dict[str, list[Prediction]], header: list[str]) -> str:
    """The table: one row per strategy and flag combination, the configured one first; the row
    ``finetune`` would run starred."""
    cols = list(TERMS)
    names = [_SHORT.get(c, c) for c in cols]
    head = (f"  {'strategy':<8} {'AC':<3} {'offl':<4} {'peak MB':>8} {'fits':>4}  "
            + " ".join(f"{n:>7}" for n in names) + f" {'read MB':>8}  peak at")
    lines = [*header, "", head]
    for strategy, preds in predictions.items():
        for p in preds:
            star = "*" if p.runs else " "
            flags = f"{star} {strategy:<8} {_on(p.activation_checkpointing):<3} {_on(p.cpu_offload):<4}"
            if not p.terms:
                lines.append(f"{flags} {'-':>8} {'-':>4}  {p.note}")
                continue
            values = " ".join(f"{p.terms[c]:7.0f}" for c in cols)
            note = f" ({p.note})" if p.note else ""
            lines.append(f"{flags} {p.peak_mb:8.0f} {_fits(p.fits):>4}  {values} {p.read_mb:8.0f}  {p.moment}{note}")
    lines += ["", "* the row finetune would run. The first row of each strategy has the flags given; the others vary "
              "--activation-checkpointing (AC) and --cpu-offload.",
              "MB are 2^20 bytes per rank. peak = the sum of the terms at the busiest moment of a step:"]
    explained = [*((n, TERMS[c]) for c, n in zip(cols, names)),
                 ("read MB", "checkpoint bytes each rank reads while loading (plan reads only the headers)")]
    width = max(len(n) for n, _ in explained)
    for name, text in explained:
        wrapped = textwrap.wrap(text, 100 - width)
        lines += [f"  {name if i == 0 else '':<{width}}  {part}" for i, part in enumerate(wrapped)]
    return "\n".join(lines)


def _rows_line(cfg: Config, lengths: Lengths | None) -> str:
    width = row_tokens(cfg, lengths)
    if cfg.data.packing:
        return f"rows of {width} tokens (packed)"
    if lengths is None:
        return f"rows of up to {width} tokens (--seq-len: no --data to measure the records by)"
    return (f"rows of up to {width} tokens: the longest record of {cfg.data.train} "
            f"(mean {lengths.mean:.0f}), after --seq-len {cfg.data.seq_len}")


def run_plan(config: str | Path | None, overrides: dict[str, Any], as_json_output: bool) -> int:
    """``shardtune plan``: the run plan ``finetune`` would resolve for these flags (refusing what it
    refuses), and the predictions per strategy for its micro-batch; reads no weights."""
    from shardtune.runtime.logs import quiet_libraries

    quiet_libraries()
    cfg = build_config(config, overrides)
    validate(cfg, need_data=False)
    budget, where = budget_of(cfg)
    lengths = training_lengths(cfg)  # finetune sizes a step by them too (preflight)
    cfg, run, chosen = resolve(cfg, lengths)
    device, traced = plan_device(cfg.parallel.device)
    predictions = plan(cfg, budget, run, lengths)
    why = run.why if run is not None else ""
    if as_json_output:
        out: dict[str, Any] = as_json(predictions)
        if chosen is not None:
            out["chosen"] = {**dataclasses.asdict(chosen), "why": why}
        out["run_plan"] = run.as_dict() if run is not None else None
        print(json.dumps(out, indent=2))
        return 0
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    quant = ", base in NF4 (--quantize nf4)" if cfg.model.quantize == "nf4" else ""
    budget_text = "unknown" if budget is None else format_size(budget)
    header = [
        f"shardtune plan: {cfg.model.path} ({cfg.model.dtype}{quant}), LoRA r={cfg.lora.r} on {cfg.lora.targets}",
        f"{ranks} rank{'s' * (ranks > 1)} (single: 1), global batch {cfg.train.batch_size}"
        f"{' (packed)' if cfg.data.packing else ''}, --seq-len {cfg.data.seq_len}, device {device.type}; "
        f"memory per rank {budget_text} ({where})",
        _rows_line(cfg, lengths),
    ]
    if why:
        header += [f"finetune would run: {why}"]
    elif run is not None:
        header += [f"finetune would run: {run.strategy}, micro-batch {run.batch.micro_batch_size} (as given)"]
    if traced != device:
        header.append("activations from a fake-tensor pass on the CPU device (no CUDA here); "
                      "GPU terms (CUDA context, NCCL buffers and gathers) added")
    print(render(predictions, header))
    return 0
