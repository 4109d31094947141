"""The fastest configuration that fits: what ``auto`` means for --strategy, --micro-batch-size and
--fsdp-unit (and activation checkpointing, when nothing fits without it).

Decided once, by ``resolve`` (train/resolve.py), from the planner's memory predictions for every
candidate the combination rules allow (``config.combination_refusal``); every rank receives the
result in the run plan.

The planner predicts memory only. Among the candidates that fit, the speed rule is, in order:

1. no activation checkpointing (recomputing every layer's forward adds about a third to the compute);
2. the fewest weight collectives per optimizer step: forward passes × units gathered per forward
   (ddp and single gather nothing; FSDP2 gathers each unit in forward and again in backward, so
   whole-layer units beat per-projection ones, and a larger micro-batch means fewer forwards);
3. the largest micro-batch (fewer, larger matmuls).

The count of collectives is what sets a step's time over a network (NCCL, gloo's TCP). On one CPU
host FSDP2 gathers through shared memory (parallel/host_gather.py), where the unit size changes the
memory more than the speed, so the rule can rank two settings that run level; ``bench/speed.py
--jobs rule`` measures the settings it ranks first (bench/results/).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardtune.config import Config, ConfigError, combination_refusal, parse_size
from shardtune.model.footprint import model_facts
from shardtune.model.meta import compute_dtype
from shardtune.runtime.memory import MB, format_size
from shardtune.train.memory_model import default_budget, plan_device, predict, row_tokens
from shardtune.train.objectives import objective_of

if TYPE_CHECKING:
    from shardtune.train.data.records import Lengths

log = logging.getLogger("shardtune")
#: What ``--strategy auto`` chooses among on several ranks (fsdp1 only when named: fsdp2 does all it does).
AUTO_STRATEGIES = ("ddp", "fsdp2")


@dataclass(frozen=True)
class Candidate:
    strategy: str
    micro_batch_size: int
    activation_checkpointing: bool
    fsdp_unit: str  # "layer"/"part" under fsdp2, "-" otherwise
    peak_mb: float
    collectives: int  # weight gathers per optimizer step (forward and backward)
    forwards: int

    def key(self) -> tuple:
        return (self.activation_checkpointing, self.collectives, self.forwards, -self.micro_batch_size)

    def describe(self) -> str:
        unit = f", {self.fsdp_unit} units" if self.strategy == "fsdp2" else ""
        return (f"{self.strategy}{unit}, micro-batch {self.micro_batch_size}, activation checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}")


def needs_choice(cfg: Config) -> bool:
    return (cfg.parallel.strategy == "auto" or cfg.train.micro_batch_size == "auto"
            or (cfg.parallel.fsdp_unit == "auto" and cfg.parallel.strategy in ("auto", "fsdp2")))


def budget_of(cfg: Config) -> tuple[int | None, str]:
    """Bytes per rank, and where that number came from (None: planning for GPUs on a machine without one)."""
    if cfg.parallel.memory_per_rank:
        return parse_size(cfg.parallel.memory_per_rank), f"--memory-per-rank {cfg.parallel.memory_per_rank}"
    device, _ = plan_device(cfg.parallel.device)
    return default_budget(cfg.parallel.nproc, device)


def rows_per_rank(cfg: Config, world: int, lengths: Lengths | None) -> int:
    """Sequences a rank runs per step: its records, or under --packing about as many packed rows as its
    records' tokens fill (``lengths``: the data's; unknown: one row per record)."""
    per_rank = cfg.train.batch_size // world
    if not cfg.data.packing or lengths is None or not lengths.mean:
        return per_rank
    return max(1, min(per_rank, math.ceil(per_rank * lengths.mean / cfg.data.seq_len)))


def _micro_sizes(cfg: Config, world: int, rows: int) -> list[int]:
    if cfg.train.micro_batch_size not in (None, "auto"):
        return [int(cfg.train.micro_batch_size)]
    if cfg.train.micro_batch_size is None:
        return [rows]
    return [m for m in range(1, rows + 1) if rows % m == 0 or cfg.data.packing]


def candidates(cfg: Config, budget: int, lengths: Lengths | None = None) -> list[tuple[Candidate, bool]]:
    """Every setting the auto options allow, with its predicted peak and whether it fits.

    ``lengths``: the training data's record lengths (preflight knows them): under --packing the mean
    sets how many packed rows, so forwards, a step takes; unpacked, the longest sets a row's width."""
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    if cfg.parallel.strategy != "auto":
        strategies = [cfg.parallel.strategy]
    elif ranks == 1:
        strategies = ["single"]
    else:  # what auto may pick: those the combination rules allow
        strategies = [s for s in AUTO_STRATEGIES if combination_refusal(cfg, s) is None]
    rows = {s: rows_per_rank(cfg, ranks, lengths) for s in strategies}
    micros = {s: _micro_sizes(cfg, ranks, rows[s]) for s in strategies}
    auto = cfg.parallel.strategy == "auto" or cfg.train.micro_batch_size == "auto"
    acs = [True] if cfg.parallel.activation_checkpointing else ([False, True] if auto else [False])
    device, traced = plan_device(cfg.parallel.device)
    width = row_tokens(cfg, lengths)
    facts = model_facts(cfg, {objective_of(cfg).rows_per_forward(m) for ms in micros.values() for m in ms},
                        {compute_dtype(cfg)}, traced, width)
    out = []
    for strategy in strategies:
        units = (["layer", "part"] if cfg.parallel.fsdp_unit == "auto" else [cfg.parallel.fsdp_unit]) \
            if strategy == "fsdp2" else ["-"]
        for micro in micros[strategy]:
            forwards = -(-rows[strategy] // micro)
            for ac in acs:
                for unit in units:
                    p = predict(facts, strategy, ranks, objective_of(cfg).rows_per_forward(micro), width, ac,
                                cfg.parallel.cpu_offload, device, cfg.parallel.replicate_groups,
                                unit if unit != "-" else "part")
                    gathers = _gathers_per_forward(strategy, unit, facts)
                    c = Candidate(strategy, micro, ac, unit, p.peak_mb, 2 * gathers * forwards, forwards)
                    out.append((c, p.peak_mb * MB <= budget))
    return out


def _gathers_per_forward(strategy: str, unit: str, facts) -> int:
    if strategy in ("ddp", "single"):
        return 0
    per_layer = 1 if unit == "layer" or strategy == "fsdp1" else len(facts.units_bytes)
    return facts.layers * per_layer + 1  # + the root


def choose(cfg: Config, lengths: Lengths | None = None) -> tuple[Config, Candidate | None, str]:
    """``cfg`` with its auto options decided, the candidate chosen, and why, in words
    (``lengths``: see ``candidates``)."""
    if not needs_choice(cfg):
        return cfg, None, ""
    budget, where = budget_of(cfg)
    if budget is None:  # `plan --device cuda` on a machine without a GPU: every prediction, no choice
        if cfg.train.micro_batch_size == "auto":
            raise ConfigError("option 'micro-batch-size': 'auto' needs --memory-per-rank when planning for GPUs "
                              "on a machine without one")
        return cfg, None, ""
    found = candidates(cfg, budget, lengths)
    fitting = sorted((c for c, fits in found if fits), key=Candidate.key)
    if fitting:
        best = fitting[0]
        why = (f"fastest setting that fits {format_size(budget)} per rank ({where}): {best.describe()}, predicted "
               f"peak {format_size(best.peak_mb * MB)}; {len(fitting)} of {len(found)} settings fit; rule: no "
               f"activation checkpointing, then fewest weight collectives per step ({best.collectives}), then "
               f"largest micro-batch")
    else:
        best = min((c for c, _ in found), key=lambda c: c.peak_mb)
        if cfg.parallel.memory_per_rank:
            raise ConfigError(f"option 'memory-per-rank': no setting fits {format_size(budget)} per rank; the "
                              f"smallest predicted peak is {format_size(best.peak_mb * MB)} ({best.describe()})")
        why = (f"nothing fits {format_size(budget)} per rank ({where}); the smallest predicted peak: "
               f"{best.describe()}, {format_size(best.peak_mb * MB)}")
    parallel = dataclasses.replace(
        cfg.parallel, strategy=best.strategy, activation_checkpointing=best.activation_checkpointing,
        fsdp_unit=best.fsdp_unit if best.strategy == "fsdp2" else cfg.parallel.fsdp_unit, chosen=why)
    train = dataclasses.replace(cfg.train, micro_batch_size=best.micro_batch_size)
    return dataclasses.replace(cfg, parallel=parallel, train=train), best, why
