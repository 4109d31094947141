"""One training step and one evaluation, for every objective.

A step runs this rank's forwards of the global batch: each is scored by the loss head (per-token
log-probabilities of the targets, never the full logits), the objective turns the scores into the
forward's share of the batch's loss (divided by the batch's global normalisers, so the shares of all
forwards on all ranks add up to the batch's loss however it is split), and that share is backpropagated
at once. Evaluation runs the same terms over a validation set without gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.parallel import Strategy
from shardtune.parallel.activation_offload import offloaded
from shardtune.runtime import distributed
from shardtune.runtime.distributed import Worker
from shardtune.train.data.batch import Batcher, Forward
from shardtune.train.loss_head import score
from shardtune.train.objectives import Objective
from shardtune.train.reference import Reference
from shardtune.train.scaling import ShardedGradScaler


@dataclass
class StepResult:
    loss: float
    tokens: int  # real tokens of the global batch
    fill: float  # the share of all ranks' computed positions that are real tokens
    metrics: dict[str, float]  # the objective's own (SFT: token accuracy; preference: TRL's rewards/… and logps/…)


@dataclass
class Trainee:
    """What a step works on: the rank's model and how it is spread, its objective and reference."""

    model: nn.Module
    strategy: Strategy | None  # None: a whole model per rank (shardtune eval), no gradients
    objective: Objective
    reference: Reference | None
    worker: Worker
    offload: bool = False  # --activation-offload: what forwards save waits in host memory (GPUs)


def train_step(t: Trainee, batcher: Batcher, batch: list[int], forwards: list[Forward],
               scaler: ShardedGradScaler) -> StepResult:
    """Forward/backward of this rank's ``forwards`` of the global batch ``batch`` (item indices).

    Nothing here waits for the device until the step's end: the sums stay a device tensor, and gradients
    are reduced over ranks once, in the last forward's backward.
    """
    device, world = t.worker.device, t.worker.world_size
    norms = t.objective.norms(batcher, batch)
    sums = torch.zeros(1 + len(t.objective.metrics), dtype=torch.float32, device=device)
    for n, fwd in enumerate(forwards):
        reference = t.reference.values(t.model, fwd) if t.reference is not None else None
        with t.strategy.gradient_sync(t.model, enabled=n == len(forwards) - 1):
            with offloaded(device, t.offload):
                scores = score(t.model, fwd.inputs, fwd.targets, t.objective.temperature, fwd.scored)
            terms = t.objective.terms(scores, fwd, batcher, norms, reference)
            # Gradient sync averages over ranks; multiplying by world_size turns that average back into
            # the sum over ranks, so the gradient is that of the global batch's loss whatever the split.
            scaler.scale(terms.loss * world).backward()
        sums += torch.cat([terms.loss.detach().reshape(1), terms.sums])
    positions = distributed.all_reduce_sum(sum(f.positions for f in forwards), device)
    if world > 1:
        torch.distributed.all_reduce(sums)
    loss, *rest = sums.tolist()
    tokens = batcher.tokens(batch)
    return StepResult(loss, tokens, tokens / positions, t.objective.summarize(rest, norms))


@torch.no_grad()
def evaluation_sums(t: Trainee, batcher: Batcher, n_items: int, micro: int, together: bool = True,
                    on_forward: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's sums of the objective's terms (loss first, then its metric sums, float64) over its share
    of ``n_items`` items (every world_size-th), and the set's norms: added over ranks, ``summarize`` turns
    them into the loss over the whole set and the metrics. ``together``: the model is sharded, so every
    rank runs as many forwards as the busiest. ``on_forward(items, tokens)`` after each (a progress bar).
    The caller chooses eval()/train()."""
    worker = t.worker
    norms = t.objective.norms(batcher, list(range(n_items)))
    sums = torch.zeros(1 + len(t.objective.metrics), dtype=torch.float64, device=worker.device)
    for fwd in batcher.lockstep(n_items, micro, worker.rank, worker.world_size, together):
        reference = t.reference.values(t.model, fwd) if t.reference is not None else None
        scores = score(t.model, fwd.inputs, fwd.targets, scored=fwd.scored)
        if fwd.items:
            terms = t.objective.terms(scores, fwd, batcher, norms, reference)
            sums += torch.cat([terms.loss.reshape(1), terms.sums]).double()
            if on_forward is not None:
                on_forward(len(fwd.items), fwd.real_tokens)
    return sums, norms


def summarize(objective: Objective, sums: list[float], norms: dict[str, float]) -> dict[str, float]:
    """``loss`` and the objective's metrics from ``evaluation_sums`` added over every rank."""
    return {"loss": sums[0], **objective.summarize(sums[1:], norms)}


def evaluate(t: Trainee, batcher: Batcher, n_items: int, micro: int) -> dict[str, float]:
    """The validation figures over ``n_items`` items of a sharded model, on every rank."""
    sums, norms = evaluation_sums(t, batcher, n_items, micro)
    if t.worker.world_size > 1:
        torch.distributed.all_reduce(sums)
    return summarize(t.objective, sums.tolist(), norms)
