"""Preference objectives on sequence log-probabilities: DPO (sigmoid, IPO), ORPO and SimPO, as TRL defines them.

A pair's log-probability of a response is the sum of its target tokens' log-probabilities; ORPO, SimPO
and IPO use the mean per target token instead. The loss of a global batch is the mean over its pairs of
each pair's loss (plus, for ORPO, the mean NLL over every target token of the chosen responses), however
the batch is split over ranks and micro-batches: a pair's two sequences always share one forward, so
each micro-batch contributes ``sum(pair losses) / global_pairs`` (+ ``chosen NLL sum / global chosen
tokens``), which is linear and sums to the global loss.

Formulas (TRL 1.16: ``DPOTrainer`` with loss_type sigmoid / ipo, ``ORPOTrainer``, ``CPOTrainer`` with
loss_type simpo and cpo_alpha 0):
  dpo sigmoid  −(1−ε)·logσ(βΔ) − ε·logσ(−βΔ),  Δ = (π_c − ref_c) − (π_r − ref_r) on summed log-probs
  dpo ipo      (Δ̄ − 1/(2β))²,  Δ̄ the same on per-token means
  orpo         NLL(chosen) − λ·logσ(log odds(π̄_c) − log odds(π̄_r)),  odds(p) = p / (1 − p)
  simpo        −logσ(β·(π̄_c − π̄_r) − γ)
Rewards (logged as TRL names them): β·(π − ref) for DPO, λ·π̄ for ORPO, β·π̄ for SimPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardtune.config import Config

#: per-step metrics, TRL's names, each a mean over the global batch's pairs
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class Objective:
    name: str  # "sft", "dpo", "orpo" or "simpo"
    beta: float = 0.1  # dpo, simpo: β; orpo: λ
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"  # dpo: sigmoid or ipo
    gamma: float = 0.0  # simpo's margin

    @property
    def pairs(self) -> bool:
        return self.name != "sft"

    @property
    def reference(self) -> bool:
        """Whether the loss compares against a reference model (the base, adapter off)."""
        return self.name == "dpo"

    @property
    def token_means(self) -> bool:
        """Whether the loss reads per-token mean log-probs (else sums)."""
        return self.name in ("orpo", "simpo") or self.loss_type == "ipo"


def rows_per_forward(cfg: Config, micro_batch: int) -> int:
    """Sequences of up to --seq-len one forward computes for a micro-batch of ``micro_batch``: records, or
    under a preference objective two per pair (chosen and rejected; packed, a row of 2 × --seq-len holds
    the same tokens). The reference forward runs under no_grad: it keeps no activations, so the policy's
    forward is the one whose memory the planner counts, with or without --precompute-reference."""
    return micro_batch * (2 if cfg.train.objective != "sft" else 1)


def objective_of(cfg: Config) -> Objective:
    p, name = cfg.preference, cfg.train.objective
    if name == "dpo":
        return Objective(name, p.dpo_beta, p.dpo_label_smoothing, p.dpo_loss)
    if name == "orpo":
        return Objective(name, p.orpo_lambda)
    if name == "simpo":
        return Objective(name, p.simpo_beta, gamma=p.simpo_gamma)
    return Objective(name)


@dataclass
class PairTerms:
    """One micro-batch's pairs: the loss per pair, and what the metrics average."""

    losses: torch.Tensor  # (pairs,), with grad
    nll_sum: torch.Tensor  # ORPO: summed NLL of the chosen target tokens, with grad; 0 otherwise
    rewards_chosen: torch.Tensor  # (pairs,), detached
    rewards_rejected: torch.Tensor
    logps_chosen: torch.Tensor  # (pairs,), detached: as the loss reads them (sums or means)
    logps_rejected: torch.Tensor

    def metric_sums(self) -> torch.Tensor:
        """Sums over this micro-batch's pairs, in METRICS order (the caller divides by the global pairs)."""
        margins = self.rewards_chosen - self.rewards_rejected
        return torch.stack([self.rewards_chosen.sum(), self.rewards_rejected.sum(), (margins > 0).float().sum(),
                            margins.sum(), self.logps_chosen.sum(), self.logps_rejected.sum()])


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, without cancellation on either side of −ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_terms(objective: Objective, chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
               rejected_tokens: torch.Tensor, ref_chosen: torch.Tensor | None = None,
               ref_rejected: torch.Tensor | None = None) -> PairTerms:
    """The objective's terms from summed log-probs (pairs,) of the policy (and of the reference for DPO);
    ``*_tokens``: target tokens per response."""
    zero = chosen.new_zeros(())
    if objective.token_means:
        mean_c, mean_r = chosen / chosen_tokens, rejected / rejected_tokens
    if objective.name == "dpo":
        assert ref_chosen is not None and ref_rejected is not None
        ratio_c, ratio_r = chosen - ref_chosen, rejected - ref_rejected
        if objective.loss_type == "ipo":
            delta = ratio_c / chosen_tokens - ratio_r / rejected_tokens
            losses = (delta - 1 / (2 * objective.beta)) ** 2
        else:
            z = objective.beta * (ratio_c - ratio_r)
            eps = objective.label_smoothing
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return PairTerms(losses, zero, objective.beta * ratio_c.detach(), objective.beta * ratio_r.detach(),
                         chosen.detach(), rejected.detach())
    if objective.name == "orpo":
        log_odds = (mean_c - mean_r) - (_log1mexp(mean_c) - _log1mexp(mean_r))
        losses = -objective.beta * F.logsigmoid(log_odds)
        return PairTerms(losses, -chosen.sum(), objective.beta * mean_c.detach(), objective.beta * mean_r.detach(),
                         mean_c.detach(), mean_r.detach())
    if objective.name == "simpo":
        losses = -F.logsigmoid(objective.beta * (mean_c - mean_r) - objective.gamma)
        return PairTerms(losses, zero, objective.beta * mean_c.detach(), objective.beta * mean_r.detach(),
                         mean_c.detach(), mean_r.detach())
    raise ValueError(f"no pair loss for objective {objective.name!r}")
