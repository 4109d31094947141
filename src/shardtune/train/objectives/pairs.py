"""What the preference objectives share: a batch of pairs, each pair's two sequence log-probabilities.

Pair ``p`` of a dataset is examples ``2p`` (chosen) and ``2p + 1`` (rejected); the sampler draws pairs,
so ``--batch-size`` counts pairs, and a pair's two sequences always share one forward (its loss needs
both). A pair's log-probability of a response is the sum of its target tokens' log-probabilities; ORPO,
SimPO and IPO use the mean per target token instead. The loss of a global batch is the mean over its
pairs of each pair's loss (plus, for ORPO, the mean NLL over every target token of the chosen
responses): each forward contributes ``sum(its pair losses) / global pairs`` (+ ``its chosen NLL sum /
global chosen tokens``), which is linear and sums to the global loss. Under context parallelism the
sequence sums are added over the pieces first (``sequence_sums``), and each of the N ranks counts 1/N.
Rewards (logged as TRL names them): β·(π − ref) for DPO, λ·π̄ for ORPO, β·π̄ for SimPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtune.train.data.batch import Batcher, Forward, sequence_sums
from shardtune.train.data.pairs import PAIRS
from shardtune.train.loss_head import Scores
from shardtune.train.objectives.base import Objective, Terms

#: per-step metrics, TRL's names, each a mean over the global batch's pairs
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass
class PairTerms:
    """One forward's pairs: the loss per pair, and what the metrics average."""

    losses: torch.Tensor  # (pairs,), with grad
    nll_sum: torch.Tensor  # ORPO: summed NLL of the chosen target tokens, with grad; 0 otherwise
    rewards_chosen: torch.Tensor  # (pairs,), detached
    rewards_rejected: torch.Tensor
    logps_chosen: torch.Tensor  # (pairs,), detached: as the loss reads them (sums or means)
    logps_rejected: torch.Tensor

    def metric_sums(self) -> torch.Tensor:
        """Sums over this forward's pairs, in METRICS order (divided by the batch's pairs later)."""
        margins = self.rewards_chosen - self.rewards_rejected
        return torch.stack([self.rewards_chosen.sum(), self.rewards_rejected.sum(), (margins > 0).float().sum(),
                            margins.sum(), self.logps_chosen.sum(), self.logps_rejected.sum()])


class PairObjective(Objective):
    """A preference objective on sequence log-probabilities; subclasses give ``pair_terms``."""

    records = PAIRS
    metrics = METRICS

    def norms(self, batcher: Batcher, items: list[int]) -> dict[str, float]:
        return {"pairs": float(len(items)), "chosen_targets": float(sum(e.targets for e in
                                                                        batcher.sequences(items)[::2]))}

    def terms(self, scores: Scores, fwd: Forward, batcher: Batcher, norms: dict[str, float],
              reference: torch.Tensor | None) -> Terms:
        logps = sequence_sums(scores.logps, fwd).view(-1, 2)
        counts = torch.tensor([e.targets for e in batcher.sequences(fwd.items)], dtype=torch.float32,
                              device=logps.device).view(-1, 2)
        ref = (reference[:, 0], reference[:, 1]) if reference is not None else (None, None)
        terms = self.pair_terms(logps[:, 0], logps[:, 1], counts[:, 0], counts[:, 1], *ref)
        loss = terms.losses.sum() / norms["pairs"]
        if norms["chosen_targets"]:
            loss = loss + terms.nll_sum / norms["chosen_targets"]
        # every term comes from whole-sequence sums: under context parallelism each rank of a group holds
        # them all, and counts its share, so that the group counts each pair once
        return Terms(loss * fwd.share, terms.metric_sums() * fwd.share)

    def summarize(self, sums: list[float], norms: dict[str, float]) -> dict[str, float]:
        return {name: v / norms["pairs"] for name, v in zip(METRICS, sums)}

    def reference_of(self, scores: Scores, fwd: Forward) -> torch.Tensor:
        """(pairs, 2): the summed log-probs of each pair's chosen and rejected response."""
        return sequence_sums(scores.logps, fwd).view(-1, 2)

    def pair_terms(self, chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                   rejected_tokens: torch.Tensor, ref_chosen: torch.Tensor | None,
                   ref_rejected: torch.Tensor | None) -> PairTerms:
        """The terms from summed log-probs (pairs,) of the policy (and of the reference); ``*_tokens``:
        target tokens per response."""
        raise NotImplementedError
