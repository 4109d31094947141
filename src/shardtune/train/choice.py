"""The one search over the settings a configuration may run with: the fastest one that fits is what
``auto`` means for --strategy, --micro-batch-size and --fsdp-unit (and activation checkpointing, when
nothing fits without it), and ``shardtune plan`` prints its rows (``strategy_rows``).

Decided once, by ``resolve`` (train/resolve.py), from the memory model's predictions for every
candidate the combination rules allow (``config.combination_refusal``); every rank receives the
result in the run plan. One ``Search`` per command computes the model facts the predictions need once.

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

from shardtune.config import (
    STRATEGIES,
    Config,
    ConfigError,
    combination_refusal,
    parse_size,
    ranks_of,
    traits,
    unit_of,
    units_to_try,
)
from shardtune.model.attention import context_parallel_refusal
from shardtune.model.footprint import Facts, meta_lora_model, model_facts
from shardtune.runplan import BatchError, BatchSplit, RunPlan
from shardtune.runtime.device import decide_dtype, planned_device_type, trace_device
from shardtune.runtime.memory import MB, format_size
from shardtune.train.memory_model import (
    Prediction,
    Setting,
    default_budget,
    default_memory_per_rank,
    predict,
    row_tokens,
)
from shardtune.train.objectives import objective_of

if TYPE_CHECKING:
    from torch import nn

    from shardtune.train.data.records import Lengths

log = logging.getLogger("shardtune")


@dataclass(frozen=True)
class Candidate:
    strategy: str
    micro_batch_size: int
    activation_checkpointing: bool
    fsdp_unit: str  # "layer"/"part" under fsdp2, "-" otherwise
    peak_mb: float
    collectives: int  # weight gathers per optimizer step (forward and backward)
    forwards: int
    mlp_tile: int = 0  # tokens per MLP tile; 0: untiled
    context_parallel: int = 1  # ranks each sequence is cut over

    def key(self) -> tuple:
        # context parallelism last of all: it halves the data parallelism, so only when nothing else fits
        return (self.context_parallel, self.activation_checkpointing, bool(self.mlp_tile), self.collectives,
                self.forwards,
                -self.micro_batch_size)

    def describe(self) -> str:
        unit = f", {self.fsdp_unit} units" if traits(self.strategy).fsdp_unit else ""
        cp = f", context parallel {self.context_parallel}" if self.context_parallel > 1 else ""
        tiles = f", MLP tiles of {self.mlp_tile} tokens" if self.mlp_tile else ""
        return (f"{self.strategy}{unit}{cp}, micro-batch {self.micro_batch_size}, activation checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}{tiles}")


class Search:
    """The predicted peak of any setting of one configuration, for one command.

    The model facts are computed once, when first needed: the model built on meta once (or the one the
    caller built), one fake-tensor pass per micro-batch size. The automatic choice (``candidates``) and
    ``shardtune plan``'s table (``strategy_rows``) read the same search, so ``plan`` with an ``auto``
    option computes them once, not once per view.
    """

    def __init__(self, cfg: Config, lengths: Lengths | None = None, model: nn.Module | None = None) -> None:
        self.cfg = decide_dtype(cfg)  # the compute dtype sizes the model: --dtype auto decided first
        self.lengths = lengths
        self.device = planned_device_type(cfg.parallel.device)  # 'cuda' or 'cpu'
        self.traced = trace_device(self.device)
        self.width = row_tokens(self.cfg, lengths)
        self._model = model
        self._facts: Facts | None = None

    @property
    def model(self) -> nn.Module:
        """The LoRA model on meta (what the nf4 split rule reads too)."""
        if self._model is None:
            self._model = meta_lora_model(self.cfg)
        return self._model

    @property
    def facts(self) -> Facts:
        if self._facts is None:
            self._facts = model_facts(self.cfg, self.traced, self.width, self.model)
        return self._facts

    def setting(self, strategy: str, ranks: int, micro_batch_size: int) -> Setting:
        """``strategy`` on ``ranks`` with micro-batches of ``micro_batch_size`` records (or pairs), with
        this configuration's rows and flags (``dataclasses.replace`` varies them)."""
        p, objective = self.cfg.parallel, objective_of(self.cfg)
        cp = p.context_parallel if p.context_parallel != "auto" and traits(strategy).context_parallel else 1
        # an objective that generates samples all of a rank's completions of the batch at once (unless a vLLM
        # server samples them: --vllm-url)
        sampled_here = objective.generates and not self.cfg.grpo.vllm_url
        generation = (self.cfg.train.batch_size // ranks, self.width) if sampled_here else (0, 0)
        return Setting(strategy, ranks, objective.rows_per_forward(micro_batch_size), self.width,
                       p.activation_checkpointing, p.cpu_offload, p.replicate_groups, unit_of(strategy, p.fsdp_unit),
                       mlp_tile=tile_of(self.cfg), loss_chunk=p.loss_chunk or 0,
                       activation_offload=p.activation_offload, context_parallel=cp,
                       generation_rows=generation[0], generation_tokens=generation[1])

    @property
    def auto_tile(self) -> int:
        return auto_mlp_tile(self.facts)

    def tiles_to_try(self) -> list[int]:
        """--mlp-tile's values the choice weighs: untiled and ``auto_mlp_tile`` for 'auto', else the given one."""
        tile = self.cfg.parallel.mlp_tile
        if tile == "auto":
            return [0, self.auto_tile]
        return [int(tile or 0)]

    def context_sizes(self, ranks: int, every: bool = False) -> list[int]:
        """The --context-parallel sizes to weigh: the one given, or under 'auto' (or ``every``: ``plan
        --seq-len max``) 1 and each that the ranks (of each replica group), the batch and the model allow."""
        p = self.cfg.parallel
        if p.context_parallel != "auto" and not every:
            return [int(p.context_parallel)]
        sizes = [1]
        for n in range(2, ranks + 1):
            cfg = dataclasses.replace(self.cfg, parallel=dataclasses.replace(p, context_parallel=n))
            able = next(s for s, t in STRATEGIES.items() if t.context_parallel)
            if (combination_refusal(cfg, able, ranks) is None and context_parallel_refusal(self.model, n) is None
                    and self.cfg.train.batch_size % (ranks // n) == 0):
                sizes.append(n)
        return sizes

    def predict(self, setting: Setting) -> Prediction:
        return predict(self.facts, setting, self.device)


def tile_of(cfg: Config) -> int:
    """Tokens per MLP tile of ``cfg`` as decided (0: untiled; 'auto' before the choice counts as untiled)."""
    tile = cfg.parallel.mlp_tile
    return 0 if tile in (None, "auto") else int(tile)


def auto_mlp_tile(facts: Facts) -> int:
    """``--mlp-tile auto``'s tile when the run needs one: hidden-size tokens (as ALST tiles), so a tile's MLP
    set is about a layer's weights' size whatever the context."""
    return facts.hidden


def needs_choice(cfg: Config) -> bool:
    return (cfg.parallel.strategy == "auto" or cfg.train.micro_batch_size == "auto" or cfg.parallel.mlp_tile == "auto"
            or cfg.parallel.context_parallel == "auto"
            or (cfg.parallel.fsdp_unit == "auto"
                and (cfg.parallel.strategy == "auto" or traits(cfg.parallel.strategy).fsdp_unit)))


def _asks_choice(cfg: Config) -> bool:
    """Whether the user left the setting itself to the planner (not only --mlp-tile, which it settles quietly)."""
    return needs_choice(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mlp_tile=None)))


class NothingFits(ConfigError):
    """No setting fits an explicit budget (or a GPU's): ``resolve`` words it with the longest --seq-len that
    would fit (train/longest.py, which reads this module: the search stays one-way)."""

    def __init__(self, cfg: Config, search: Search, best: Candidate, budget: int, where: str) -> None:
        super().__init__(f"option 'memory-per-rank': no setting fits {format_size(budget)} per rank; the smallest "
                         f"predicted peak is {format_size(best.peak_mb * MB)} ({best.describe()})")
        self.cfg, self.search, self.best, self.budget, self.where = cfg, search, best, budget, where


def budget_of(cfg: Config) -> tuple[int | None, str]:
    """Bytes per rank, and where that number came from (None: planning for GPUs on a machine without one)."""
    if cfg.parallel.memory_per_rank:
        return parse_size(cfg.parallel.memory_per_rank), f"--memory-per-rank {cfg.parallel.memory_per_rank}"
    return default_budget(cfg.parallel.nproc, planned_device_type(cfg.parallel.device))


def gathers_to_generate(setting: Setting) -> bool:
    """Whether ``setting`` generates (GRPO) with weights its forwards gather: sharded over several ranks."""
    return bool(setting.generation_rows) and traits(setting.strategy).shards and setting.ranks > 1


def exchanges_to_generate(cfg: Config, setting: Setting) -> bool:
    """Whether GRPO's generation can compute from the row shards without gathering a layer
    (parallel/exchanged_layers.py): FSDP2 over a shard group of several ranks, its shards on the device
    (no --cpu-offload), and plain LoRA (DoRA reads its base weight whole)."""
    return gathers_to_generate(setting) and setting.strategy == "fsdp2" and not setting.cpu_offload and \
        setting.ranks // setting.replicate_groups > 1 and cfg.lora.variant != "dora"


#: Exchanged, each token's forward spends a few collectives per layer (latency) to spare each rank the reading
#: of (N - 1)/N of every layer's weights (bandwidth): worth it where that share of a layer exceeds these bytes
#: (what a rank reads in about the time of those collectives). CPU and gloo: set between a 14 MB layer, where
#: generation ran slower exchanged, and a 176 MB one, where a step ran faster (bench/grpo_vs_trl.py, 2 ranks);
#: CUDA and NCCL: microseconds of latency against TB/s of memory, the layers kept gathered wherever they fit.
EXCHANGE_PAYS_FROM = {"cpu": 64 * MB, "cuda": 1024 * MB}


#: Replicated (every rank of a shard group sampling all of the group's rows), a token's forward spends one
#: collective a projection instead of the exchange's two, and each rank reads, in every layer, the other ranks'
#: KV cache too: worth it where those bytes are below what a rank reads in about the time of the collectives
#: spared, half of those ``EXCHANGE_PAYS_FROM`` weighs.
REPLICATED_READS_UP_TO = {device: limit // 2 for device, limit in EXCHANGE_PAYS_FROM.items()}


def replicates_to_generate(search: Search, setting: Setting) -> bool:
    """Whether an exchanged generation (``generation_exchanged``) spares collectives by having every rank of a
    shard group sample all of the group's rows (``generation_replicated``): where the KV cache of the other ranks'
    rows that a token's forward then reads in each layer stays within ``REPLICATED_READS_UP_TO``."""
    shards = setting.ranks // setting.replicate_groups
    f = search.facts
    others = (shards - 1) * setting.generation_rows * setting.generation_tokens * f.kv_bytes_per_token
    return others / max(f.layers, 1) <= REPLICATED_READS_UP_TO[search.device]


#: A frozen projection's exchange moves, per token and decoder layer, about this many hidden states: the inputs
#: of the attention's projections, its output's and the MLP's (four gathered), and their outputs (Llama's MLP is
#: about 2.7 hidden states wide: gate's, up's and down's outputs, q's, k's, v's and o's).
EXCHANGED_HIDDENS = 16


def exchanges_to_train(search: Search, setting: Setting) -> bool:
    """Whether GRPO's training too computes the frozen projections from their row shards (``layers_exchanged``),
    where generation does (``exchanges_to_generate``): a micro-batch then moves each layer's inputs and outputs
    once a pass (forward, backward, and the recompute under activation checkpointing) instead of FSDP2's two
    gathers of the layer. Taken where that moves no more than the layer a pass computes with (half of what it
    replaces: the exchange's collectives are many and small): a 4-bit base's layer counts at its dequantized
    size, which FSDP2's ranks each make whole in every pass, and exchanged only their rows of it. Not with
    context parallelism (whole rows only)."""
    f = search.facts
    if setting.context_parallel > 1:
        return False
    passes = 3 if setting.activation_checkpointing else 2
    moved = passes * setting.rows * setting.row_tokens * EXCHANGED_HIDDENS * f.hidden * f.compute_itemsize
    return moved <= f.block_bytes + f.nf4_dequantized_bytes / max(f.layers, 1)


def dequantizes_gathered_per_token(search: Search, setting: Setting, budget: int | None) -> bool:
    """Whether a 4-bit base's weights, kept gathered for a generation, fit ``budget`` only in NF4: every token's
    forward would then dequantize every layer whole, which costs more than the exchange's collectives (on CPU,
    bench/grpo_vs_trl.py's nf4 rows); exchanged, each rank dequantizes only its rows, and once where they fit."""
    if not search.facts.nf4_dequantized_bytes or budget is None:
        return False
    kept = dataclasses.replace(setting, generation_gathered=True)
    return search.predict(kept).peak_mb * MB <= budget < \
        search.predict(dataclasses.replace(kept, generation_dequantized=True)).peak_mb * MB


def generation_gathered(search: Search, setting: Setting, budget: int | None) -> tuple[Setting, Prediction]:
    """``setting`` with what GRPO's generation gathers decided, and the prediction it runs by. The weights stay
    gathered for the whole generation (``generation_gathered``) when the predicted peak with the whole model
    gathered fits ``budget`` (bytes per rank; None: nothing to judge by, not kept), unless computing from the
    row shards (``generation_exchanged``, where ``exchanges_to_generate``) is the faster way
    (``EXCHANGE_PAYS_FROM``); that is also taken whenever the gathered model does not fit (it gathers nothing,
    while the per-token gathering moves every layer for every token), and for a 4-bit base whose gathered
    weights fit but not all of them dequantized (``dequantizes_gathered_per_token``). A 4-bit base's NF4 weights
    are then dequantized once per generation (``generation_dequantized``) when the peak with all of them (the
    rank's rows, exchanged) in the compute dtype fits too. Exchanged, training computes from the row shards too where
    that moves fewer bytes (``exchanges_to_train``: ``layers_exchanged``), and every rank of a shard group samples
    all of the group's rows where that pays (``replicates_to_generate``) and fits (``generation_replicated``).
    Kept gathered, the weights stay so into the training step that follows (``generation_carried``: its forward
    and backward gather none of them) when its predicted peak with all of them held fits too.
    A setting that does not generate, or whose strategy gathers nothing for a forward (``gathers_to_generate``),
    is returned unchanged."""
    chosen, prediction = setting, search.predict(setting)
    if not gathers_to_generate(setting):
        return chosen, prediction

    def fits(candidate: Setting) -> Prediction | None:
        predicted = search.predict(candidate)
        return predicted if budget is not None and predicted.peak_mb * MB <= budget else None

    how: dict[str, bool] = {"generation_gathered": True}
    base = fits(dataclasses.replace(setting, **how))
    if exchanges_to_generate(search.cfg, setting):
        shards = setting.ranks // setting.replicate_groups
        f = search.facts  # a layer as a token's forward reads it: 4-bit weights dequantized, in the compute dtype
        read = f.block_bytes + f.nf4_dequantized_bytes / max(f.layers, 1)
        pays = read * (shards - 1) / shards >= EXCHANGE_PAYS_FROM[search.device]
        rows = {"generation_exchanged": True, "layers_exchanged": exchanges_to_train(search, setting)}
        exchanged = search.predict(dataclasses.replace(setting, **rows))  # never above the per-token gathering
        # instead of 4-bit weights kept gathered, only where it fits too
        fewer_dequantized = dequantizes_gathered_per_token(search, setting, budget) and \
            exchanged.peak_mb * MB <= budget
        if pays or base is None or fewer_dequantized:
            how, base = rows, exchanged
            if replicates_to_generate(search, setting):
                replicated = fits(dataclasses.replace(setting, **how, generation_replicated=True))
                if replicated is not None:
                    how, base = {**how, "generation_replicated": True}, replicated
    if base is None:
        return chosen, prediction
    chosen, prediction = dataclasses.replace(setting, **how), base
    if search.facts.nf4_dequantized_bytes:
        once = dataclasses.replace(setting, **how, generation_dequantized=True)
        predicted = fits(once)
        if predicted is not None:
            chosen, prediction = once, predicted
    if chosen.generation_gathered:  # two gathers of the model spared a step, where the training fits with it too
        carried = dataclasses.replace(chosen, generation_carried=True)
        predicted = fits(carried)
        if predicted is not None:
            chosen, prediction = carried, predicted
    return chosen, prediction


def recomputes_4bit(search: Search, setting: Setting) -> bool:
    """Whether ``setting`` has a recompute that could keep a 4-bit base's dequantized weights for the backward:
    4-bit weights in the decoder layers, activation checkpointing, and training with whole weights. Not
    ``layers_exchanged``: its backward dequantizes only the rank's rows of each weight, and keeping those from the
    recompute measured no faster, while holding a layer's rows at once."""
    return bool(search.facts.nf4_layer_dequantized_bytes) and setting.activation_checkpointing \
        and not setting.layers_exchanged


def recompute_dequantized(search: Search, setting: Setting, budget: int | None) -> tuple[Setting, Prediction]:
    """``setting`` with whether a 4-bit base's recompute keeps each layer's dequantized weights for its backward
    (``recompute_dequantized``: one dequantization of each weight fewer a micro-batch), and the prediction it runs
    by: where it ``recomputes_4bit``, when the predicted peak with them fits ``budget`` (None: nothing to judge
    by, not kept)."""
    prediction = search.predict(setting)
    if budget is None or not recomputes_4bit(search, setting):
        return setting, prediction
    kept = dataclasses.replace(setting, recompute_dequantized=True)
    predicted = search.predict(kept)
    return (kept, predicted) if predicted.peak_mb * MB <= budget else (setting, prediction)


def settled(search: Search, setting: Setting, budget: int | None) -> tuple[Setting, Prediction]:
    """``setting`` with what is decided once its strategy, micro-batch and checkpointing are, each where it fits
    ``budget``: GRPO's generation (``generation_gathered``), then a 4-bit base's recompute
    (``recompute_dequantized``); and the prediction it runs by."""
    return recompute_dequantized(search, generation_gathered(search, setting, budget)[0], budget)


def rows_per_rank(cfg: Config, world: int, lengths: Lengths | None) -> int:
    """Sequences a rank runs per step: its records, or under --packing about as many packed rows as its
    records' tokens fill (``lengths``: the data's; unknown: one row per record)."""
    per_rank = cfg.train.batch_size // world
    if not cfg.data.packing or lengths is None or not lengths.mean:
        return per_rank
    return max(1, min(per_rank, math.ceil(per_rank * lengths.mean / cfg.data.seq_len)))


def _micro_sizes(cfg: Config, rows: int) -> list[int]:
    if cfg.train.micro_batch_size not in (None, "auto"):
        return [int(cfg.train.micro_batch_size)]
    if cfg.train.micro_batch_size is None:
        return [rows]
    return [m for m in range(1, rows + 1) if rows % m == 0 or cfg.data.packing]


def checkpointing_to_try(cfg: Config) -> list[bool]:
    """--activation-checkpointing's values the choice weighs: both when the strategy or the micro-batch is
    left to it (it turns checkpointing on when nothing fits without), else the one given."""
    auto = "auto" in (cfg.parallel.strategy, cfg.train.micro_batch_size, cfg.parallel.context_parallel)
    return [True] if cfg.parallel.activation_checkpointing else ([False, True] if auto else [False])


def candidates(cfg: Config, budget: int, lengths: Lengths | None = None,
               search: Search | None = None) -> list[tuple[Candidate, bool]]:
    """Every setting the auto options allow, with its predicted peak and whether it fits.

    ``lengths``: the training data's record lengths (preflight knows them): under --packing the mean
    sets how many packed rows, so forwards, a step takes; unpacked, the longest sets a row's width.
    ``search``: the command's (default: a new one for ``cfg`` and ``lengths``)."""
    search = search or Search(cfg, lengths)
    lengths = search.lengths
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    if cfg.parallel.strategy != "auto":
        strategies = [cfg.parallel.strategy]
    elif ranks == 1:
        strategies = [s for s, t in STRATEGIES.items() if t.one_process]
    else:  # what auto may pick: those the combination rules allow
        strategies = [s for s, t in STRATEGIES.items() if t.auto and combination_refusal(cfg, s) is None]
    acs = checkpointing_to_try(cfg)
    out = []
    for cp in search.context_sizes(ranks):
        rows = rows_per_rank(cfg, ranks // cp, lengths)  # a CP group's ranks share their rows
        for strategy in strategies:
            if cp > 1 and not traits(strategy).context_parallel:
                continue
            for micro in _micro_sizes(cfg, rows):
                forwards = -(-rows // micro)
                for ac in acs:
                    for unit in units_to_try(strategy, cfg.parallel.fsdp_unit):
                        for tile in search.tiles_to_try():
                            if tile and unit == "part":  # tiles go with whole-layer units (combination_refusal)
                                continue
                            setting = dataclasses.replace(search.setting(strategy, ranks, micro), context_parallel=cp,
                                                          activation_checkpointing=ac, fsdp_unit=unit, mlp_tile=tile)
                            p = search.predict(setting)
                            gathers = _gathers_per_forward(strategy, unit, search.facts)
                            c = Candidate(strategy, micro, ac, unit, p.peak_mb, 2 * gathers * forwards, forwards,
                                          tile, cp)
                            out.append((c, p.peak_mb * MB <= budget))
    return out


def _gathers_per_forward(strategy: str, unit: str, facts: Facts) -> int:
    if not traits(strategy).shards:
        return 0
    # FSDP1 always wraps whole layers; FSDP2 whole layers or their parts (--fsdp-unit)
    per_layer = len(facts.units_bytes) if unit == "part" else 1
    return facts.layers * per_layer + 1  # + the root


def choose(cfg: Config, lengths: Lengths | None = None,
           search: Search | None = None) -> tuple[Config, Candidate | None, str]:
    """``cfg`` with its auto options decided, the candidate chosen, and why, in words
    (``lengths``, ``search``: see ``candidates``)."""
    if not needs_choice(cfg):
        return cfg, None, ""
    budget, where = budget_of(cfg)
    if budget is None:  # `plan --device cuda` on a machine without a GPU: every prediction, no choice
        if cfg.train.micro_batch_size == "auto":
            raise ConfigError("option 'micro-batch-size': 'auto' needs --memory-per-rank when planning for GPUs "
                              "on a machine without one")
        return untiled(cfg), None, ""
    search = search or Search(cfg, lengths)
    found = candidates(cfg, budget, lengths, search)
    fitting = sorted((c for c, fits in found if fits), key=Candidate.key)
    shrunk = not fitting and cfg.train.micro_batch_size is None
    if shrunk:  # the default micro-batch does not fit: fewer rows per forward (the same global batch) may
        acs = checkpointing_to_try(cfg)  # as the options given allow: only the micro-batch changes
        found = [(c, fits) for c, fits in candidates(dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, micro_batch_size="auto")), budget, lengths, search)
            if c.activation_checkpointing in acs]
        fitting = sorted((c for c, fits in found if fits), key=Candidate.key)
        shrunk = bool(fitting)
    asked = _asks_choice(cfg) or shrunk
    if fitting:
        best = fitting[0]
        why = (f"fastest setting that fits {format_size(budget)} per rank ({where}): {best.describe()}, predicted "
               f"peak {format_size(best.peak_mb * MB)}; {len(fitting)} of {len(found)} settings fit; rule: no "
               f"context parallelism, then no activation checkpointing, then untiled MLPs, then fewest weight "
               f"collectives per step ({best.collectives}), then largest micro-batch")
        if shrunk:
            why = ("the default micro-batch (--batch-size / ranks: every row of a rank in one forward) does not fit, "
                   f"so fewer rows per forward, the global batch kept by accumulating gradients; {why}")
        if not asked:  # only --mlp-tile auto was open: a word only when it tiles
            why = (f"MLP tiled ({best.mlp_tile} tokens per tile, --mlp-tile auto): untiled, the predicted peak "
                   f"exceeds {format_size(budget)} per rank ({where})") if best.mlp_tile else ""
    else:
        best = min((c for c, _ in found), key=lambda c: c.peak_mb)
        if cfg.parallel.memory_per_rank or search.device == "cuda":
            raise NothingFits(cfg, search, best, budget, where)
        why = (f"nothing fits {format_size(budget)} per rank ({where}); the smallest predicted peak: "
               f"{best.describe()}, {format_size(best.peak_mb * MB)}") if asked else ""
    tile = best.mlp_tile or None if cfg.parallel.mlp_tile == "auto" else cfg.parallel.mlp_tile
    if not asked and not best.mlp_tile:  # nothing was open but --mlp-tile auto, and it stays untiled
        return untiled(cfg), None, ""
    parallel = dataclasses.replace(
        cfg.parallel, strategy=best.strategy, activation_checkpointing=best.activation_checkpointing, mlp_tile=tile,
        context_parallel=best.context_parallel,
        fsdp_unit=best.fsdp_unit if traits(best.strategy).fsdp_unit else cfg.parallel.fsdp_unit)
    train = dataclasses.replace(cfg.train, micro_batch_size=best.micro_batch_size)
    return dataclasses.replace(cfg, parallel=parallel, train=train), best, why


def untiled(cfg: Config) -> Config:
    """``cfg`` with --mlp-tile auto settled as untiled (nothing, or no budget, asked for tiles)."""
    if cfg.parallel.mlp_tile != "auto":
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mlp_tile=None))


def strategy_rows(cfg: Config, memory_per_rank: int | None = None, run: RunPlan | None = None,
                  lengths: Lengths | None = None, search: Search | None = None) -> dict[str, list[Prediction]]:
    """``shardtune plan``'s rows: {strategy: predictions} for ``cfg``'s micro-batch (after the choice);
    the first of each is for the configured checkpointing/offload flags, the others vary them. A row
    that cannot run says why in its note, in the words of the rule that refuses it
    (``config.combination_refusal``, ``BatchSplit.of``); ``run``: the plan ``finetune`` would run,
    whose row is marked (``Prediction.runs``); ``lengths``: the training data's, which size a step's
    rows (``memory_model.row_tokens``); ``search``: the command's. Single is shown on one rank."""
    search = search or Search(cfg, lengths)
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    budget = memory_per_rank or default_memory_per_rank(cfg.parallel.nproc, search.device)
    batches: dict[str, BatchSplit | str] = {}
    cp = cfg.parallel.context_parallel if cfg.parallel.context_parallel != "auto" else 1
    for strategy in STRATEGIES:
        n = cp if traits(strategy).context_parallel else 1  # the others refuse it, by the rule's words
        try:
            batches[strategy] = BatchSplit.of(cfg.train.batch_size, cfg.train.micro_batch_size,
                                               ranks_of(strategy, ranks) // n, cfg.data.packing, n)
        except BatchError as err:
            batches[strategy] = str(err)
    if not any(isinstance(b, BatchSplit) for b in batches.values()):
        raise BatchError(next(iter(batches.values())))  # type: ignore[arg-type]
    given = (cfg.parallel.activation_checkpointing, cfg.parallel.cpu_offload)
    out: dict[str, list[Prediction]] = {}
    for strategy, batch in batches.items():
        world = ranks_of(strategy, ranks)
        offloads = (False, True) if traits(strategy).cpu_offload else (False,)
        flags = [given] + [(ac, off) for ac in (False, True) for off in offloads if (ac, off) != given]
        preds = []
        for ac, off in flags:
            flagged = dataclasses.replace(cfg, parallel=dataclasses.replace(
                cfg.parallel, activation_checkpointing=ac, cpu_offload=off))
            refused = batch if isinstance(batch, str) else combination_refusal(flagged, strategy, world)
            if refused:
                preds.append(Prediction(strategy, world, ac, off, {}, "", note=refused))
                continue
            setting = dataclasses.replace(search.setting(strategy, world, batch.micro_batch_size),
                                          activation_checkpointing=ac, cpu_offload=off,
                                          fsdp_unit=unit_of(strategy, cfg.parallel.fsdp_unit),
                                          mlp_tile=tile_of(cfg))  # the search's cfg is from before the choice
            p = settled(search, setting, budget)[1]
            p.fits = None if budget is None else p.peak_mb * MB <= budget
            p.runs = run is not None and (run.strategy, run.activation_checkpointing, run.cpu_offload) == \
                (strategy, ac, off)
            preds.append(p)
        if all(not p.terms for p in preds) and len({p.note for p in preds}) == 1:
            preds = preds[:1]  # one reason for every row of the strategy: said once
        out[strategy] = preds
    return out
