"""The run plan: the facts of a run, decided once, in one frozen value every rank receives.

``shardtune.train.resolve.resolve`` makes it from the configuration and this machine's facts (the
only function that decides anything); the launcher, plain torchrun, ``python -m shardtune.train``,
``shardtune plan`` and the Python API all go through it. The workers receive it and check that
it is theirs (``RunPlan.check``); they never decide again. Which options combine is one rule,
``config.combination_refusal``; ``RunPlan.of`` never makes a plan that breaks it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shardtune.config import Config, ConfigError, combination_refusal, unit_of


class BatchError(ConfigError):
    """--batch-size, --micro-batch-size and the ranks do not make a batch split."""


@dataclass(frozen=True)
class BatchSplit:
    """How one global batch of ``batch_size`` records splits over ranks and forward passes.

    Without packing a rank's records split into micro-batches of ``micro_batch_size`` records
    (accumulated); with packing its records are packed into rows and ``micro_batch_size`` counts
    rows per forward, so it need not divide anything.
    """

    batch_size: int
    micro_batch_size: int
    world_size: int
    packing: bool = False

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.world_size

    @property
    def accumulation(self) -> int:
        """Forward passes per step without packing (under packing: set by the records' lengths)."""
        return self.batch_size // (self.micro_batch_size * self.world_size)

    @classmethod
    def of(cls, batch_size: int, micro_batch_size: int | None, world_size: int, packing: bool = False,
           context_parallel: int = 1) -> BatchSplit:
        """The split over ``world_size`` data-parallel ranks; ``context_parallel``: said in the messages (the
        ranks are then groups of that many ranks, which share their micro-batches)."""
        ranks = f"{world_size} ranks" if context_parallel == 1 else (
            f"{world_size} data-parallel groups (of --context-parallel {context_parallel} ranks each)")
        if batch_size % world_size:
            raise BatchError(
                f"--batch-size {batch_size} is the global batch and must be a multiple of the {ranks}"
            )
        micro = micro_batch_size or batch_size // world_size
        if not packing and batch_size % (micro * world_size):
            raise BatchError(
                f"--batch-size {batch_size} cannot be made of micro-batches of {micro} on {ranks}: "
                f"it must equal micro-batch-size × ranks × accumulation steps "
                f"(e.g. --micro-batch-size {math.gcd(batch_size // world_size, micro)})"
            )
        return cls(batch_size, micro, world_size, packing)


@dataclass(frozen=True)
class GenerationWeights:
    """How GRPO's generation holds the weights, as the run plan decided (``RunPlan``'s ``generation_*`` fields,
    whose comments say what each means): what ``train/generation.py`` and the strategy's
    ``gathered_for_generation`` act on. The default: every token's forward gathers what it uses."""

    gathered: bool = False
    dequantized: bool = False
    exchanged: bool = False
    replicated: bool = False
    carried: bool = False

    @property
    def carries(self) -> bool:
        """Whether the weights stay gathered from the generation into the training that follows: carried, and
        only what was kept gathered can be."""
        return self.carried and self.gathered


#: every token's forward gathers what it uses (a sharded strategy) or holds the whole model (DDP, one rank)
GATHERED_PER_TOKEN = GenerationWeights()


@dataclass(frozen=True)
class RunPlan:
    """What every rank runs; nothing in it is 'auto'."""

    strategy: str  # fsdp2, fsdp1, ddp or single
    fsdp_unit: str  # FSDP2's unit: "layer" or "part"; "-" under other strategies
    batch: BatchSplit
    seq_len: int
    dtype: str  # bf16, fp16 or fp32: frozen weights and compute
    device: str  # cpu or cuda
    backend: str  # the process group's backend
    activation_checkpointing: bool
    cpu_offload: bool
    replicate_groups: int
    quantize: str  # none or nf4: checked against the strategy (config.combination_refusal)
    lora_variant: str  # lora or dora: likewise
    mlp_tile: int = 0  # tokens per MLP tile (parallel/tiling.py); 0: untiled
    loss_chunk: int = 0  # tokens per loss-head chunk (train/loss_head.py); 0: its default
    activation_offload: bool = False  # saved activations to pinned host memory (GPUs)
    #: ranks per context-parallel group: each sequence is cut into this many pieces; ``batch`` is split over
    #: the world size / this many data-parallel groups (the ranks of a group share their micro-batches)
    context_parallel: int = 1
    #: GRPO under a sharded strategy: the weights stay gathered for a whole generation instead of being
    #: gathered again by every token's forward; decided by ``resolve`` from the predicted peak and the budget
    generation_gathered: bool = False
    #: kept gathered, a 4-bit base's NF4 weights are dequantized once per generation instead of in every
    #: token's forward (the same values); decided likewise, when all of them in the compute dtype fit too
    generation_dequantized: bool = False
    #: FSDP2 on a shard group of several ranks: no layer is gathered for the generation, each projection
    #: computes every rank's tokens from its row shards (parallel/exchanged_layers.py); decided likewise
    generation_exchanged: bool = False
    #: exchanged, every rank of a shard group samples all of the group's rows: no input moves, each projection's
    #: outputs are all-gathered (half the collectives); decided likewise, where the other ranks' KV cache that
    #: each rank then reads costs less than the collectives spared (``choice.REPLICATED_READS_UP_TO``)
    generation_replicated: bool = False
    #: kept gathered, the weights stay gathered from the generation into the training step that follows, until its
    #: backward shards them: its forward and backward gather none (two gathers of the model spared a generation
    #: batch); decided likewise, when the training's peak with the whole model gathered fits too
    generation_carried: bool = False
    #: FSDP2 on a shard group of several ranks, GRPO's training too: the frozen projections stay row-sharded
    #: outside FSDP and compute every rank's tokens where they lie, in forward and backward
    #: (parallel/exchanged_layers.py ``exchange_in_place``); decided likewise, from the bytes a step moves
    layers_exchanged: bool = False
    #: --quantize nf4 under activation checkpointing: a layer's recompute keeps its NF4 weights' dequantized
    #: values until their backward, which then dequantizes none (model/nf4_torchao.py
    #: ``recompute_keeps_values``; one dequantization of each weight fewer a micro-batch, the same values);
    #: decided likewise, when the peak with one layer's weights in the compute dtype fits
    recompute_dequantized: bool = False
    why: str = ""  # what the automatic choice picked and why; "" when nothing was left to choose

    @property
    def world_size(self) -> int:
        """All ranks: the data-parallel ranks times the ranks of a context-parallel group."""
        return self.batch.world_size * self.context_parallel

    @property
    def generation(self) -> GenerationWeights:
        """How GRPO's generation holds the weights (the ``generation_*`` fields)."""
        return GenerationWeights(self.generation_gathered, self.generation_dequantized, self.generation_exchanged,
                                 self.generation_replicated, self.generation_carried)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunPlan:
        return cls(**{**data, "batch": BatchSplit(**data["batch"])})

    def check(self, cfg: Config, world_size: int, device: str, batch: bool = True) -> None:
        """Raise when this plan is not the one for ``cfg`` on these ranks: a worker asserts, never re-decides.
        ``batch=False``: all but the batch split (building a model makes no batches)."""
        if not batch:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(
                cfg.train, batch_size=self.batch.batch_size, micro_batch_size=self.batch.micro_batch_size))
        if cfg.parallel.mlp_tile == "auto":  # decided by the planner, from the memory a rank may use
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mlp_tile=self.mlp_tile or None))
        # decided from the memory a rank may use, as the automatic choice is: carried, not re-decided
        expected = dataclasses.replace(RunPlan.of(cfg, world_size, device, self.backend, self.why),
                                       generation_gathered=self.generation_gathered,
                                       generation_dequantized=self.generation_dequantized,
                                       generation_exchanged=self.generation_exchanged,
                                       generation_replicated=self.generation_replicated,
                                       generation_carried=self.generation_carried,
                                       layers_exchanged=self.layers_exchanged,
                                       recompute_dequantized=self.recompute_dequantized)
        if expected != self:
            diff = {k: (v, getattr(self, k)) for k, v in dataclasses.asdict(expected).items()
                    if getattr(self, k) != (BatchSplit(**v) if k == "batch" else v)}
            raise RuntimeError(f"the run plan received differs from this rank's configuration: {diff}")

    @classmethod
    def of(cls, cfg: Config, ranks: int, device: str, backend: str, why: str = "") -> RunPlan:
        """The plan of ``cfg``, which must have nothing left to choose, on ``ranks`` ranks of ``device``.

        Checks every combination rule and the batch arithmetic; it decides nothing (``resolve`` does).
        """
        p, t = cfg.parallel, cfg.train
        for flag, value in (("strategy", p.strategy), ("micro-batch-size", t.micro_batch_size),
                            ("dtype", cfg.model.dtype), ("mlp-tile", p.mlp_tile),
                            ("context-parallel", p.context_parallel)):
            if value == "auto":
                raise ConfigError(f"option '{flag}': 'auto' is decided by shardtune.train.resolve before a run starts")
        refused = combination_refusal(cfg, p.strategy, ranks)
        if refused:
            raise ConfigError(refused)
        batch = batch_split(cfg, ranks)
        return cls(p.strategy, unit_of(p.strategy, p.fsdp_unit), batch, cfg.data.seq_len, cfg.model.dtype, device,
                   backend, p.activation_checkpointing, p.cpu_offload, p.replicate_groups, cfg.model.quantize,
                   cfg.lora.variant, int(p.mlp_tile or 0), p.loss_chunk or 0, p.activation_offload,
                   p.context_parallel, why=why)


def batch_split(cfg: Config, ranks: int) -> BatchSplit:
    """The batch split of ``cfg`` on ``ranks`` ranks: over its data-parallel groups (ranks /
    --context-parallel), whose ranks share every micro-batch, each taking its piece of the sequences."""
    cp = cfg.parallel.context_parallel
    return BatchSplit.of(cfg.train.batch_size, cfg.train.micro_batch_size, ranks // cp, cfg.data.packing, cp)
