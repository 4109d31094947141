"""ORPO, as TRL 1.16's ``ORPOTrainer``: no reference model; the chosen responses' NLL plus λ times an
odds-ratio term on per-token mean log-probs:

  NLL(chosen) − λ·logσ(log odds(π̄_c) − log odds(π̄_r)),  odds(p) = p / (1 − p)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardtune.train.objectives.pairs import PairObjective, PairTerms


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, without cancellation on either side of −ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class Orpo(PairObjective):
    name = "orpo"

    def __init__(self, lambda_: float = 0.1) -> None:
        self.lambda_ = lambda_

    def pair_terms(self, chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen, ref_rejected) -> PairTerms:
        mean_c, mean_r = chosen / chosen_tokens, rejected / rejected_tokens
        log_odds = (mean_c - mean_r) - (_log1mexp(mean_c) - _log1mexp(mean_r))
        losses = -self.lambda_ * F.logsigmoid(log_odds)
        return PairTerms(losses, -chosen.sum(), self.lambda_ * mean_c.detach(), self.lambda_ * mean_r.detach(),
                         mean_c.detach(), mean_r.detach())
