"""GRPO (and Dr. GRPO, DAPO, GSPO...), as TRL 1.16's ``GRPOTrainer``: the policy's own completions of each
prompt, scored by reward functions, each completion's tokens pushed by its advantage within its group.

A step's items are the completions of its generation batch (a ``Rollout``, made by train/rollout.py before
the step: sampled, scored, advantages over whole groups, and the old policy's and the reference's
log-probs where needed, and with a vLLM sampler the importance-sampling ratio that corrects for its
probabilities and its own log-probs for off-policy masking); ``--batch-size`` counts completions. A
forward's sequences are prompt + completion with the completion's tokens as targets; the loss head scores
them at the sampling temperature, and ``grpo_loss.grpo_terms`` turns each forward's per-token log-probs into
its share of the step's loss, with the global counts of the whole batch (``norms``): N ranks train exactly
like one.

Metrics: the loss's (``kl``, ``clip_ratio/*``: masked means over the whole batch) and the rollout's
(``reward``, ``reward_std``, ``rewards/<fn>/mean``, ``completions/*``, with a vLLM sampler ``sampling/*``: TRL's
names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtune.train.data.batch import Batcher, Forward
from shardtune.train.data.prompts import PROMPTS
from shardtune.train.grpo_loss import Counts, GRPOSettings, grpo_terms, loss_mask
from shardtune.train.loss_head import Scores
from shardtune.train.objectives.base import Objective, Terms

#: the loss's metrics, each a masked mean: [numerator, denominator] summed over forwards and ranks
SUMS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio",
        "vespo/phi_seq_mean")


@dataclass
class Rollout:
    """One generation batch, the same on every rank: rows are completions, group-major (rows g·G … g·G+G−1
    are prompt ``prompts[g]``'s)."""

    index: int  # the generation batch: optimizer step // num_iterations
    prompts: list[int]  # the dataset's prompt indices, one per group
    completions: list[list[int]]  # token ids per row (EOS included where the completion ended with one)
    truncated: list[bool]  # cut by --max-completion-length
    rewards: torch.Tensor  # (rows, functions), NaN where a function answered None
    advantages: torch.Tensor  # (rows,)
    mask: torch.Tensor  # (rows, width) the loss mask of each row's completion tokens
    metrics: dict[str, float]  # the rollout's: reward, reward_std, rewards/<fn>/..., completions/...
    micro_batches: int  # forwards of a step over all ranks (bnpo's normaliser)
    old: torch.Tensor | None = None  # (rows, width) log-probs at generation time (num_iterations > 1)
    ref: torch.Tensor | None = None  # (rows, width) the reference's (β > 0)
    is_ratio: torch.Tensor | None = None  # a vLLM sampler's importance-sampling ratio: (rows, width) or (rows, 1)
    sampling: torch.Tensor | None = None  # (rows, width) a vLLM sampler's log-probs (--off-policy-mask-threshold)
    temperature: float | None = None  # sampled at (its log-probs' temperature); None: a checkpoint from before

    @property
    def width(self) -> int:
        return self.mask.size(1)

    def state(self) -> dict:
        return dict(vars(self))


def make_mask(completions: list[list[int]], truncated: list[bool], mask_truncated: bool) -> torch.Tensor:
    lengths = torch.tensor([len(c) for c in completions])
    return loss_mask(lengths, torch.tensor(truncated), int(lengths.max()), mask_truncated)


def per_sequence(values: torch.Tensor, fwd: Forward, width: int) -> torch.Tensor:
    """(sequences, width): each sequence's values at its targets, in order, left-aligned (0 after its last);
    differentiable. A completion's targets are its tokens, so row i holds its completion's log-probs."""
    flat, owners = values.reshape(-1), fwd.owners.reshape(-1)
    positions = (owners >= 0).nonzero().squeeze(1)
    own = owners[positions]
    order = torch.argsort(own, stable=True)
    positions, own = positions[order], own[order]
    counts = torch.bincount(own, minlength=fwd.sequences)
    index = torch.arange(own.numel(), device=own.device) - (counts.cumsum(0) - counts)[own]
    return values.new_zeros(fwd.sequences, width).index_put((own, index), flat[positions])


class Grpo(Objective):
    name = "grpo"
    records = PROMPTS
    metrics = tuple(f"{name}{part}" for name in SUMS for part in ("", "#count"))
    generates = True

    def __init__(self, settings: GRPOSettings, temperature: float = 1.0, num_generations: int = 8,
                 num_iterations: int = 1) -> None:
        self.settings, self.num_generations, self.num_iterations = settings, num_generations, num_iterations
        self.temperature = temperature if temperature > 0 else 1.0  # greedy: scored as sampled at 1
        self.rollout: Rollout | None = None  # the current generation batch (train/rollout.py sets it)

    def epoch_items(self, records: int) -> int:
        """Each prompt is drawn once an epoch, for num_generations completions, each stepped num_iterations times."""
        return records * self.num_generations * self.num_iterations

    def records_per_batch(self, batch_size: int) -> int:
        return batch_size // self.num_generations  # --batch-size counts completions

    def _current(self) -> Rollout:
        if self.rollout is None:
            raise RuntimeError("--objective grpo: a step needs its generation batch first (train/rollout.py)")
        return self.rollout

    def norms(self, batcher: Batcher, items: list[int]) -> dict[str, float]:
        r = self._current()
        return {"rows": float(len(items)), "tokens": float(r.mask[items].sum()),
                "micro_batches": float(r.micro_batches)}

    def terms(self, scores: Scores, fwd: Forward, batcher: Batcher, norms: dict[str, float],
              reference: torch.Tensor | None) -> Terms:
        r = self._current()
        device = scores.logps.device
        items = fwd.items
        logps = per_sequence(scores.logps, fwd, r.width)[:len(items)]

        def rows(table: torch.Tensor | None) -> torch.Tensor | None:
            return table[items].to(device) if table is not None else None

        counts = Counts(int(norms["rows"]), int(norms["tokens"]), int(norms["micro_batches"]))
        t = grpo_terms(self.settings, logps, rows(r.mask), rows(r.advantages), counts, rows(r.old), rows(r.ref),
                       is_ratio=rows(r.is_ratio), sampling_logps=rows(r.sampling))
        zero = torch.zeros(2, dtype=torch.float64, device=device)
        sums = torch.cat([t.metrics.sums.get(name, zero) for name in SUMS]).float()
        return Terms(t.loss, sums)

    def summarize(self, sums: list[float], norms: dict[str, float]) -> dict[str, float]:
        out = {name: sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(SUMS) if sums[2 * i + 1] > 0}
        return {**out, **(self.rollout.metrics if self.rollout is not None else {})}

    def rows_per_forward(self, micro_batch: int) -> int:
        return micro_batch
