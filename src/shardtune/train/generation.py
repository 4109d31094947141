"""Completions sampled by the policy itself, as it is spread over the ranks (GRPO's rollouts).

The model generates as it trains: the adapter on, each rank its own rows of the generation batch, a KV
cache (train/sampling.py: each completion seeded by its prompt and index, so the rows a rank gets change
nothing). How the weights are spread decides only how a forward runs:

* FSDP2: every forward gathers each unit's weights as in training, so every rank runs a forward per token
  while any rank has an unfinished row (``keep_going``: an all-reduce per token), feeding padding once its
  own rows are done, its prompts left-padded to the widest of every rank's (``widest_prompt``): every
  forward then carries as many tokens on every rank; when the planner found that they fit
  (``RunPlan.generation_gathered``: ``gathered``), the layers are gathered once and kept for the whole
  generation (``Strategy.gathered_for_generation``), the same numbers without a gather per token, and where
  the training that follows fits with them too (``RunPlan.generation_carried``: ``carried``), they stay
  gathered until its backward shards them (the adapter is the one generation sampled with); or the
  layers are never gathered either (``RunPlan.generation_exchanged``: ``exchanged``): each projection
  computes every rank's tokens on the rows here and sends each rank its outputs
  (parallel/exchanged_layers.py), or, where every rank of a shard group samples all of the group's rows
  (``RunPlan.generation_replicated``: ``replicated``, the same completions on each), each rank's outputs are
  all-gathered, one collective a projection instead of two, and no all-reduce decides when to stop (every
  rank sees every row); the row-sharded embedding tables are never gathered (each rank looks up
  and projects every rank's tokens on its own rows: parallel/sharded_embeddings.py); a 4-bit base's NF4
  weights are then dequantized once for the generation (the rank's rows only, when exchanged), not in every
  token's forward, when they fit too (``RunPlan.generation_dequantized``: ``dequantized``;
  model/nf4_torchao.py, the same values);
* DDP and single: each rank holds the whole model and generates on its own, without collectives (DDP's
  wrapper, which would broadcast buffers in every forward, is left out).

The attention is switched to transformers' ``sdpa`` while generating (left-padded prompts need the padding
mask that the training attention never builds), the model is in eval mode, and the loss head returns
logits (it scores only inside ``score``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from shardtune.config import traits
from shardtune.model.attention import sdpa_attention
from shardtune.model.nf4_torchao import dequantized_once
from shardtune.parallel import Strategy
from shardtune.runplan import GATHERED_PER_TOKEN, GenerationWeights
from shardtune.runtime.distributed import Worker, all_reduce_max_each
from shardtune.train.sampling import Completion, SamplingSettings, hf_cache, hf_next_logits, sample
from shardtune.train.stop import GenerationStopped


@contextlib.contextmanager
def inference(model: nn.Module, strategy: Strategy, settle: bool = True) -> Iterator[None]:
    """Eval mode and no gradients for the forwards inside; after them, what the strategy keeps gathered for a
    backward that will not come is let go (unless ``settle`` is false: a carried generation's weights, which
    the backward that follows lets go; on an error, always), and the mode is restored."""
    was_training = model.training
    model.eval()
    failed = True
    try:
        with torch.no_grad():
            yield
        failed = False
    finally:
        if settle or failed:
            strategy.after_inference(model)
        model.train(was_training)


def in_lockstep(worker: Worker, strategy: Strategy) -> bool:
    """Whether every forward of the generation is a collective: a sharded strategy on several ranks."""
    return worker.world_size > 1 and traits(strategy.name).shards


def widest_prompt(prompts: Sequence[Sequence[int]], worker: Worker) -> int:
    """The longest prompt of every rank's (one all-reduce): in lockstep every rank pads to it, so each forward
    carries as many tokens on every rank and the exchanges need not agree on a count per layer. That holds only
    if every rank has as many rows, checked in the same all-reduce (else ValueError, on every rank)."""
    rows = len(prompts)
    width, most, fewest = all_reduce_max_each([max((len(p) for p in prompts), default=0), rows, -rows],
                                              worker.device)
    if most != -fewest:
        raise ValueError(f"generation in lockstep: every rank must sample as many rows; this rank has {rows}, "
                         f"the ranks between {-fewest} and {most}")
    return int(width)


def lockstep(worker: Worker, strategy: Strategy, stopping: Callable[[], bool] | None = None):
    """``keep_going`` for ``sample``: under a sharded strategy every forward is a collective, so all ranks
    step while any has an unfinished row, and where ``stopping`` (whether this rank was asked to stop:
    train/stop.py) is given, all of them raise GenerationStopped at the same token when any rank was (one
    all-reduce a token either way); otherwise each rank stops when its own rows are done, or, asked to stop, at
    once (None where there is nothing to ask)."""
    if not in_lockstep(worker, strategy):
        return None if stopping is None else lambda unfinished: unfinished and not stopping()

    def keep_going(unfinished: bool) -> bool:
        going, stop = all_reduce_max_each([int(unfinished), int(bool(stopping and stopping()))], worker.device)
        if stop:
            raise GenerationStopped
        return bool(going)
    return keep_going


def generate(model: nn.Module, strategy: Strategy, worker: Worker, prompts: Sequence[Sequence[int]],
             keys: Sequence[tuple[int, int]], settings: SamplingSettings, seed: int, step: int,
             weights: GenerationWeights = GATHERED_PER_TOKEN, stopping: Callable[[], bool] | None = None
             ) -> list[Completion]:
    """This rank's completions of ``prompts`` (token ids), row i seeded by ``keys[i]`` = (prompt index, completion
    index) and ``step`` (the generation batch); every rank calls it with as many rows. ``weights``: how they are
    held (``RunPlan.generation``, module doc): ``gathered`` for the whole generation; ``exchanged``: none is
    gathered, each rank computes from its rows, and with ``replicated`` too, every rank of a shard group samples
    all of the group's rows; gathered or exchanged, ``dequantized``: the NF4 ones are dequantized once;
    gathered, ``carried``: they stay gathered for the training that follows, whose backward shards them: nothing
    may step the adapter before it. ``stopping``: whether this rank was asked to stop (``lockstep``); a rank
    sampling alone then returns its rows unfinished, and the caller must agree with the others on stopping
    (rows that every rank of a group samples stop only when done)."""
    inner = strategy.unwrap(model)  # the peft model: FSDP2's units are inside it, DDP's wrapper outside
    once = dequantized_once() if (weights.gathered or weights.exchanged) and weights.dequantized \
        else contextlib.nullcontext()
    width = widest_prompt(prompts, worker) if in_lockstep(worker, strategy) else 0
    with inference(model, strategy, settle=not weights.carries), strategy.gathered_for_generation(model, weights) \
            as group, sdpa_attention(inner), once:
        if group is None:
            return sample(hf_next_logits(inner), prompts, keys, settings, seed, step, hf_cache(inner),
                          worker.device, keep_going=lockstep(worker, strategy, stopping), width=width)
        # every rank of the group samples the same rows from the same logits: each stops when all are done
        every_prompt, every_key = group_rows(prompts, keys, width, group, worker.device)
        done = sample(hf_next_logits(inner), every_prompt, every_key, settings, seed, step, hf_cache(inner),
                      worker.device, width=width)
        return done[group.rank() * len(prompts):(group.rank() + 1) * len(prompts)]


def group_rows(prompts: Sequence[Sequence[int]], keys: Sequence[tuple[int, int]], width: int,
               group: torch.distributed.ProcessGroup, device: torch.device
               ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The prompts and keys of every rank of ``group`` in its rank order (one all-gather); each rank has as many,
    none wider than ``width`` (``widest_prompt``)."""
    table = torch.zeros(len(prompts), 3 + width, dtype=torch.long)
    for i, (prompt, key) in enumerate(zip(prompts, keys)):
        table[i, :3] = torch.tensor([len(prompt), *key])
        table[i, 3:3 + len(prompt)] = torch.tensor(list(prompt))
    table = table.to(device)
    every = table.new_empty(group.size() * len(prompts), 3 + width)
    torch.distributed.all_gather_single(every, table, group=group)
    rows = every.tolist()
    return [row[3:3 + row[0]] for row in rows], [(row[1], row[2]) for row in rows]
