"""What each strategy is: the one place that knows strategies by name.

``STRATEGIES`` holds each strategy's traits; every other module asks it (``traits(name).shards``)
instead of comparing names. Which options combine with which strategy is one rule built on it,
``rules.combination_refusal``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traits:
    """One strategy's traits (parallel/ implements each one)."""

    name: str
    shards: bool  # each rank holds 1/N of the frozen weights (else a whole copy per rank)
    one_process: bool  # runs on exactly one rank
    cpu_offload: bool  # --cpu-offload applies: the shards are kept in host memory
    hsdp: bool  # --replicate-groups > 1 applies: shard within groups, replicate across them
    nf4: bool  # --quantize nf4 works
    dora: bool  # --lora-variant dora works
    auto: bool  # --strategy auto may pick it on several ranks (on one rank auto runs the one-process one)
    fsdp_unit: bool  # --fsdp-unit applies (FSDP2: whole layers or their parts; FSDP1 always wraps layers)
    grad_buckets: bool  # keeps a second copy of the gradients (DDP's all-reduce buckets)
    row_tables: bool  # frozen embedding tables are used from row shards, outside the wrapper (sharded_embeddings)
    table_units: bool  # untied embedding tables are units of their own, each gathered whole for its use
    context_parallel: bool  # --context-parallel > 1 applies: sequences cut over groups of ranks
    generates: bool  # --objective grpo works: the policy samples its completions token by token


#: Every strategy, in the order ``shardtune plan`` lists them. fsdp1 is never picked by auto: fsdp2
#: does all it does (nf4, DoRA) with a lower peak.
STRATEGIES: dict[str, Traits] = {t.name: t for t in (
    Traits("fsdp2", shards=True, one_process=False, cpu_offload=True, hsdp=True, nf4=True, dora=True, auto=True,
           fsdp_unit=True, grad_buckets=False, row_tables=True, table_units=False, context_parallel=True,
           generates=True),
    Traits("fsdp1", shards=True, one_process=False, cpu_offload=True, hsdp=True, nf4=False, dora=False, auto=False,
           fsdp_unit=False, grad_buckets=False, row_tables=False, table_units=True,
           context_parallel=False, generates=False),
    Traits("ddp", shards=False, one_process=False, cpu_offload=False, hsdp=False, nf4=True, dora=True, auto=True,
           fsdp_unit=False, grad_buckets=True, row_tables=False, table_units=False,
           context_parallel=False, generates=True),
    Traits("single", shards=False, one_process=True, cpu_offload=False, hsdp=False, nf4=True, dora=True,
           auto=False, fsdp_unit=False, grad_buckets=False, row_tables=False, table_units=False,
           context_parallel=False, generates=True),
)}
#: What --strategy accepts
STRATEGY_CHOICES = ("auto", *STRATEGIES)
#: FSDP2's units of sharding (--fsdp-unit): whole decoder layers, or their parts
FSDP_UNITS = ("layer", "part")
NO_UNIT = "-"  # a run plan's unit under a strategy without the choice


def traits(strategy: str) -> Traits:
    try:
        return STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}") from None


def ranks_of(strategy: str, ranks: int) -> int:
    """The ranks ``strategy`` runs on when ``ranks`` are asked for (``shardtune plan`` shows one-process
    strategies on one rank)."""
    return 1 if traits(strategy).one_process else ranks


def unit_of(strategy: str, fsdp_unit: str) -> str:
    """The unit of sharding a run of ``strategy`` uses for ``--fsdp-unit fsdp_unit``: FSDP2's 'layer' or
    'part', where 'auto' left undecided (a GPU planned for from a machine without one: nothing measures
    the fit) means 'part', the lower peak; ``NO_UNIT`` under a strategy without the choice."""
    if not traits(strategy).fsdp_unit:
        return NO_UNIT
    return "part" if fsdp_unit == "auto" else fsdp_unit


def units_to_try(strategy: str, fsdp_unit: str) -> tuple[str, ...]:
    """The units the automatic choice weighs for ``strategy``: both under FSDP2 with --fsdp-unit auto."""
    if traits(strategy).fsdp_unit and fsdp_unit == "auto":
        return FSDP_UNITS
    return (unit_of(strategy, fsdp_unit),)


def groups_refusal(replicate_groups: int, ranks: int) -> str | None:
    """Why ``replicate_groups`` replica groups cannot be made of ``ranks`` ranks (None: they can)."""
    if replicate_groups < 1 or ranks % replicate_groups:
        return f"option 'replicate-groups': {replicate_groups} groups do not divide the {ranks} ranks"
    return None
