"""SimPO, as TRL 1.16's ``CPOTrainer`` with loss_type simpo and cpo_alpha 0: no reference model, a
length-normalised reward and a target margin γ:

  −logσ(β·(π̄_c − π̄_r) − γ)
"""

from __future__ import annotations

import torch.nn.functional as F

from shardtune.train.objectives.pairs import PairObjective, PairTerms


class Simpo(PairObjective):
    name = "simpo"

    def __init__(self, beta: float = 0.1, gamma: float = 0.5) -> None:
        self.beta, self.gamma = beta, gamma

    def pair_terms(self, chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen, ref_rejected) -> PairTerms:
        mean_c, mean_r = chosen / chosen_tokens, rejected / rejected_tokens
        losses = -F.logsigmoid(self.beta * (mean_c - mean_r) - self.gamma)
        zero = chosen.new_zeros(())
        return PairTerms(losses, zero, self.beta * mean_c.detach(), self.beta * mean_r.detach(),
                         mean_c.detach(), mean_r.detach())
