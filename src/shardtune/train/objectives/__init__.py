"""Objectives as components: each says what a micro-batch holds, its loss terms and metrics, and whether
it needs the reference model, behind one interface (base.py); the recipe never asks which one it runs.

    sft     next-token loss on responses            (sft.py)
    dpo     preference pairs against a reference    (dpo.py)
    orpo    preference pairs, odds ratio + NLL      (orpo.py)
    simpo   preference pairs, length-normalised     (simpo.py)
    grpo    online RL: the policy's own completions of prompts, scored by reward functions (grpo.py)
"""

from __future__ import annotations

from shardtune.config import Config
from shardtune.train.grpo_loss import GRPOSettings
from shardtune.train.objectives.base import Objective
from shardtune.train.objectives.dpo import Dpo
from shardtune.train.objectives.grpo import Grpo
from shardtune.train.objectives.orpo import Orpo
from shardtune.train.objectives.sft import Sft
from shardtune.train.objectives.simpo import Simpo


def objective_of(cfg: Config) -> Objective:
    """The objective of --objective, with its options."""
    p, name = cfg.preference, cfg.train.objective
    if name == "dpo":
        return Dpo(p.dpo_beta, p.dpo_label_smoothing, p.dpo_loss)
    if name == "orpo":
        return Orpo(p.orpo_lambda)
    if name == "simpo":
        return Simpo(p.simpo_beta, p.simpo_gamma)
    if name == "grpo":
        g = cfg.grpo
        return Grpo(grpo_settings(cfg), g.temperature, g.num_generations, g.num_iterations)
    return Sft()


def grpo_settings(cfg: Config) -> GRPOSettings:
    """The loss's settings from the GRPO options."""
    g = cfg.grpo
    return GRPOSettings(loss_type=g.loss, beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
                        importance_sampling_level=g.importance_sampling, max_completion_length=g.max_completion_length,
                        off_policy_mask_threshold=g.off_policy_mask_threshold)


__all__ = ["Objective", "objective_of", "grpo_settings"]
