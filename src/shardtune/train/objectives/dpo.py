"""DPO, as TRL 1.16's ``DPOTrainer`` (loss_type sigmoid or ipo), against the reference model (the base
with the adapter off, or the --init-adapter model):

  sigmoid  −(1−ε)·logσ(βΔ) − ε·logσ(−βΔ),  Δ = (π_c − ref_c) − (π_r − ref_r) on summed log-probs
  ipo      (Δ̄ − 1/(2β))²,  Δ̄ the same on per-token means
"""

from __future__ import annotations

import torch.nn.functional as F

from shardtune.train.objectives.pairs import PairObjective, PairTerms


class Dpo(PairObjective):
    name = "dpo"
    uses_reference = True

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0, loss_type: str = "sigmoid") -> None:
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type

    def pair_terms(self, chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen, ref_rejected) -> PairTerms:
        assert ref_chosen is not None and ref_rejected is not None
        ratio_c, ratio_r = chosen - ref_chosen, rejected - ref_rejected
        if self.loss_type == "ipo":
            delta = ratio_c / chosen_tokens - ratio_r / rejected_tokens
            losses = (delta - 1 / (2 * self.beta)) ** 2
        else:
            z = self.beta * (ratio_c - ratio_r)
            eps = self.label_smoothing
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        zero = chosen.new_zeros(())
        return PairTerms(losses, zero, self.beta * ratio_c.detach(), self.beta * ratio_r.detach(),
                         chosen.detach(), rejected.detach())

