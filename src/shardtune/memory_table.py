"""``shardtune plan``'s output: what ``finetune`` would run for these flags, and the table of each
rank's predicted peak memory per strategy, before any weight is read.

The run plan comes from ``resolve`` (train/resolve.py), the same function ``finetune`` uses, so the
two refuse the same flags. The rows come from the one search over settings (train/choice.py:
``strategy_rows``), the one the automatic choice reads, with the model facts computed once for both;
this module only lays them out: one row per strategy and flag combination, as a table or as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any

from shardtune.config import Config, ConfigError, build_config, validate
from shardtune.runtime.memory import MB, format_size
from shardtune.train.choice import Search, budget_of, strategy_rows
from shardtune.train.data.records import Lengths
from shardtune.train.longest import longest_rows
from shardtune.train.memory_model import TERMS, Prediction, row_tokens
from shardtune.train.resolve import resolve
from shardtune.train.training_data import training_lengths

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


def show(config: str | Path | None, overrides: dict[str, Any], as_json_output: bool, longest: bool = False) -> int:
    """``shardtune plan``: the run plan ``finetune`` would resolve for these flags (refusing what it
    refuses), and the predictions per strategy for its micro-batch; reads no weights. ``longest``
    (``--seq-len max``): instead, the longest sequence that fits, per strategy."""
    from shardtune.runtime.logs import quiet_libraries

    quiet_libraries()
    cfg = build_config(config, overrides)
    validate(cfg, need_data=False)
    budget, where = budget_of(cfg)
    if longest:
        return show_longest(cfg, budget, where, as_json_output)
    lengths = training_lengths(cfg)  # finetune sizes a step by them too (preflight)
    search = Search(cfg, lengths)  # the model facts, once: for the choice and for the table
    cfg, run, chosen = resolve(cfg, lengths, search=search)
    predictions = strategy_rows(cfg, budget, run, lengths, search)
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
        f"{' (packed)' if cfg.data.packing else ''}, --seq-len {cfg.data.seq_len}, device {search.device}; "
        f"memory per rank {budget_text} ({where})",
        _rows_line(cfg, lengths),
    ]
    if why:
        header += [f"finetune would run: {why}"]
    elif run is not None:
        header += [f"finetune would run: {run.strategy}, micro-batch {run.batch.micro_batch_size} (as given)"]
    if search.traced.type != search.device:
        header.append("activations from a fake-tensor pass on the CPU device (no CUDA here); "
                      "GPU terms (CUDA context, NCCL buffers and gathers) added")
    print(render(predictions, header))
    return 0


def show_longest(cfg: Config, budget: int | None, where: str, as_json_output: bool) -> int:
    """``shardtune plan --seq-len max``: per strategy, the longest sequence that fits ``budget`` as configured,
    and with the flags that would make a longer one fit (train/longest.py)."""
    if budget is None:
        raise ConfigError("option 'seq-len': max needs --memory-per-rank when planning for GPUs on a machine "
                          "without one")
    search = Search(cfg)
    rows = longest_rows(cfg, search, budget)
    if as_json_output:
        print(json.dumps({"memory_per_rank_mb": round(budget / MB, 1), "device": search.device,
                          "max_seq_len": {s: r.given for s, r in rows.items() if not r.note},
                          "longest": {s: r.as_dict() for s, r in rows.items()}}, indent=2))
        return 0
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1
    lines = [f"shardtune plan --seq-len max: {cfg.model.path} ({search.cfg.model.dtype}), LoRA r={cfg.lora.r} on "
             f"{cfg.lora.targets}, {micro} sequence{'s' * (micro > 1)} per forward, device {search.device}; memory "
             f"per rank {format_size(budget)} ({where})", "",
             f"  {'strategy':<10} {'ranks':>5} {'as configured':>14} {'with flags':>11}  flags"]
    for strategy, r in rows.items():
        if r.note:
            lines.append(f"  {strategy:<10} {r.ranks:>5} {'-':>14} {'-':>11}  {r.note}")
            continue
        lines.append(f"  {strategy:<10} {r.ranks:>5} {r.given:>14} {r.frugal:>11}  {' '.join(r.flags) or '-'}")
    lines += ["", "tokens per sequence, whole multiples of 64; 0: not even 64 tokens fit. 'with flags': with the "
              "memory savers that apply and were not given (each costs speed: recomputation, or copies to host "
              "memory). 'cpN': --context-parallel N, each sequence cut over N ranks."]
    print("\n".join(lines))
    return 0
