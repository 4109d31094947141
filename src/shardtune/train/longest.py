"""The longest sequence that fits: what ``shardtune plan --seq-len max`` answers, and what ``finetune``
names when its ``--seq-len`` does not fit.

A rank's peak grows with the row width through what a forward saves for backward (per layer, and the
loss head's per-token terms): without an s×s mask anywhere (model/attention.py) that is a polynomial of
low degree in the width. Three fake-tensor passes (footprint.py) fix it; the search then asks the memory
model at any width without tracing again, and the answer is confirmed by one more pass at that width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardtune.config import STRATEGIES, Config, combination_refusal, ranks_of, traits
from shardtune.model.footprint import Facts, Saved
from shardtune.runtime.memory import MB, format_size
from shardtune.train.choice import Candidate, Search, checkpointing_to_try
from shardtune.train.memory_model import Setting, predict

#: widths of the three fake passes the curve goes through
TRACE_WIDTHS = (1024, 2048, 4096)
#: the longest width looked for (16M tokens): beyond it, the answer is "at least this"
SEARCH_LIMIT = 1 << 24
#: answers are whole multiples of this many tokens
STEP = 64


def _fit(points: list[tuple[int, float]], width: int) -> float:
    """The quadratic through ``points`` (three (width, bytes)) at ``width`` (Lagrange's form)."""
    total = 0.0
    for i, (xi, yi) in enumerate(points):
        term = yi
        for j, (xj, _) in enumerate(points):
            if j != i:
                term *= (width - xj) / (xi - xj)
        total += term
    return total


def curve_facts(facts: Facts) -> Facts:
    """``facts`` whose saved tensors at any width come from the curve through three traced widths."""
    def trace(micro: int, dtype, width: int) -> Saved:
        known = [(w, facts.saved_for(micro, dtype, w)) for w in TRACE_WIDTHS]
        if width in TRACE_WIDTHS:
            return dict(known)[width]

        def at(get) -> int:
            return max(0, round(_fit([(w, get(s)) for w, s in known], width)))

        layers = range(len(known[0][1].per_layer))
        return Saved([at(lambda s, i=i: s.per_layer[i]) for i in layers], [at(lambda s, i=i: s.mlp[i]) for i in layers],
                     at(lambda s: s.outside), known[0][1].vocab, at(lambda s: s.backward))

    return dataclasses.replace(facts, saved={}, trace=trace)


def longest_width(facts: Facts, setting: Setting, device: str, budget: int) -> int:
    """The widest row (a multiple of STEP tokens) whose predicted peak for ``setting`` fits ``budget``
    bytes; 0 when not even STEP tokens fit. ``facts``: ``curve_facts`` of the search's."""
    def fits(width: int) -> bool:
        return predict(facts, dataclasses.replace(setting, row_tokens=width), device).peak_mb * MB <= budget

    if not fits(STEP):
        return 0
    low, high = 1, SEARCH_LIMIT // STEP  # fits(low * STEP); the answer is below high * STEP unless it fits
    if fits(high * STEP):
        return high * STEP
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * STEP) else (low, mid)
    return low * STEP


@dataclass(frozen=True)
class Longest:
    """A strategy's longest row width, with the flags given and with every memory saver that applies."""

    strategy: str
    ranks: int
    given: int  # tokens, with the flags given
    frugal: int  # tokens, with ``flags`` added
    flags: tuple[str, ...]  # the flags (beyond those given) that make ``frugal`` fit
    note: str = ""  # why the strategy has no row (a combination rule)
    context_parallel: int = 1  # ranks each sequence is cut over

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "context_parallel": self.context_parallel, "max_seq_len": self.given,
                "with_flags": {"seq_len": self.frugal, "flags": " ".join(self.flags)},
                **({"note": self.note} if self.note else {})}


def frugal(setting: Setting, search: Search) -> tuple[Setting, tuple[str, ...]]:
    """``setting`` with every memory saver that applies to it, and the flags that ask for those it lacked. MLP
    tiles and FSDP2's per-part units do not go together (config ``combination_refusal``): of the two, the one
    with the lower predicted peak."""
    cuda = search.device == "cuda"
    saver = dataclasses.replace(
        setting, activation_checkpointing=True, activation_offload=setting.activation_offload or cuda,
        cpu_offload=setting.cpu_offload or (cuda and traits(setting.strategy).cpu_offload))
    flags = [flag for flag, before, after in (
        ("--activation-checkpointing", setting.activation_checkpointing, True),
        ("--activation-offload", setting.activation_offload, saver.activation_offload),
        ("--cpu-offload", setting.cpu_offload, saver.cpu_offload))
        if after and not before]
    tiled = (dataclasses.replace(saver, mlp_tile=setting.mlp_tile or search.auto_tile, fsdp_unit="layer"
                                 if traits(setting.strategy).fsdp_unit else setting.fsdp_unit),
             () if setting.mlp_tile or search.cfg.parallel.mlp_tile == "auto" else ("--mlp-tile auto",))
    if traits(setting.strategy).fsdp_unit and setting.fsdp_unit == "part" and not setting.mlp_tile:
        tiled = (tiled[0], (*tiled[1], "--fsdp-unit layer"))
    ways = [tiled]
    if traits(setting.strategy).fsdp_unit:
        ways.append((dataclasses.replace(saver, mlp_tile=0, fsdp_unit="part"),
                     () if setting.fsdp_unit == "part" else ("--fsdp-unit part",)))
    best, added = min(ways, key=lambda way: search.predict(way[0]).peak_mb)
    return best, (*flags, *added)


def longest_rows(cfg: Config, search: Search, budget: int) -> dict[str, Longest]:
    """{strategy: its longest row width at ``budget`` bytes per rank}, for ``cfg``'s micro-batch (or one
    record per forward when the micro-batch is not given), on the ranks of ``cfg``; under a strategy that
    carries context parallelism, a row ``"<strategy> cp<N>"`` too for each other size the ranks allow."""
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1
    facts = curve_facts(search.facts)
    out = {}
    for strategy in STRATEGIES:
        world = ranks_of(strategy, ranks)
        refused = combination_refusal(cfg, strategy, world)
        if refused:
            out[strategy] = Longest(strategy, world, 0, 0, (), refused)
            continue
        setting = search.setting(strategy, world, micro)
        sizes = search.context_sizes(world, every=True) if traits(strategy).context_parallel else []
        for cp in [setting.context_parallel, *(n for n in sizes if n != setting.context_parallel)]:
            longest = _longest(search, facts, dataclasses.replace(setting, context_parallel=cp), budget)
            out[f"{strategy} cp{cp}" if cp > 1 else strategy] = longest
    return out


def _longest(search: Search, facts: Facts, setting: Setting, budget: int) -> Longest:
    given, setting = _as_configured(search, facts, setting, budget)
    most, flags = _with_savers(search, facts, setting, budget)
    return Longest(setting.strategy, setting.ranks, given, max(most, given), flags if most > given else (),
                   context_parallel=setting.context_parallel)


def _fitting_width(search: Search, facts: Facts, setting: Setting, budget: int) -> int:
    """The longest width ``setting`` fits in ``budget``: searched on the curve, confirmed by a fake pass."""
    return _confirmed(search, setting, longest_width(facts, setting, search.device, budget), budget)


def _with_savers(search: Search, facts: Facts, setting: Setting, budget: int) -> tuple[int, tuple[str, ...]]:
    """The longest width ``setting`` fits with every memory saver that applies, and the flags that add them."""
    saver, flags = frugal(setting, search)
    return _fitting_width(search, facts, saver, budget), flags


def _as_configured(search: Search, facts: Facts, setting: Setting, budget: int) -> tuple[int, Setting]:
    """The longest width ``setting`` fits as configured, and the setting that fits it: what finetune's choice
    may turn on by itself counts (--mlp-tile auto, the default, tiles whenever the untiled run does not fit;
    --strategy auto turns activation checkpointing on likewise), and is then no flag to add."""
    tried = [dataclasses.replace(setting, mlp_tile=tile, activation_checkpointing=ac)
             for tile in search.tiles_to_try() for ac in checkpointing_to_try(search.cfg)]
    widths = [_fitting_width(search, facts, s, budget) for s in tried]
    best = max(range(len(tried)), key=lambda i: widths[i])
    return widths[best], tried[best]


def _confirmed(search: Search, setting: Setting, width: int, budget: int) -> int:
    """``width``, or less, checked against a fake pass at that width itself (the curve is a fit)."""
    while width > 0:
        peak = predict(search.facts, dataclasses.replace(setting, row_tokens=width), search.device).peak_mb
        if peak * MB <= budget:
            return width
        width -= STEP
    return 0


def _levers(cfg: Config, search: Search, best: Candidate, budget: int) -> tuple[str, ...]:
    """The flags that make the requested width fit where the micro-batch and the context parallelism as given do
    not (with the memory savers they need, ``frugal``): one row per forward (the global batch kept by
    accumulation), then each row cut over more ranks (--context-parallel, on a strategy that carries it); ()
    when neither does."""
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    tries = [(best.strategy, best.context_parallel, ("--micro-batch-size 1",))] if best.micro_batch_size > 1 else []
    able = next(s for s, t in STRATEGIES.items() if t.context_parallel)
    for n in search.context_sizes(ranks, every=True):
        if n > best.context_parallel:
            strategy = () if best.strategy == able else (f"--strategy {able}",)
            tries.append((able, n, (*strategy, f"--context-parallel {n}", "--micro-batch-size 1")))
    for strategy, cp, flags in tries:
        setting = dataclasses.replace(search.setting(strategy, ranks_of(strategy, ranks), 1), context_parallel=cp)
        saver, extra = frugal(setting, search)
        for tried, added in ((setting, ()), (saver, extra)):
            if search.predict(tried).peak_mb * MB <= budget:
                return (*flags, *added)
    return ()


def too_long(cfg: Config, search: Search, best: Candidate, budget: int, where: str) -> str:
    """The refusal of a run no setting fits: the smallest peak, and the longest --seq-len that would fit."""
    setting = dataclasses.replace(search.setting(best.strategy, cfg.parallel.nproc * cfg.parallel.nnodes,
                                                 best.micro_batch_size),
                                  activation_checkpointing=best.activation_checkpointing, fsdp_unit=best.fsdp_unit,
                                  mlp_tile=best.mlp_tile)
    facts = curve_facts(search.facts)
    given = _fitting_width(search, facts, setting, budget)
    most, flags = _with_savers(search, facts, setting, budget)
    text = (f"option 'memory-per-rank': no setting fits {format_size(budget)} per rank; the smallest predicted "
            f"peak is {format_size(best.peak_mb * MB)} ({best.describe()}) at --seq-len {cfg.data.seq_len}, "
            f"budget from {where}. ")
    if most > given and most >= search.width:
        return text + f"It fits with {' '.join(flags)}."
    levers = _levers(cfg, search, best, budget)
    if levers:
        return text + f"It fits with {' '.join(levers)}."
    if given or most:
        text += f"The longest --seq-len that fits is {given} as configured"
        text += f", {most} with {' '.join(flags)}" if most > given else ""
        return text + "; or give each rank more memory, more ranks, or --quantize nf4."
    return text + ("Not even a short sequence fits: the weights and optimizer state alone exceed it; give each rank "
                   "more memory, more ranks (fsdp2), or --quantize nf4.")
