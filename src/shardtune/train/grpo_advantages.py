"""GRPO's group-relative advantages and the metrics of a generation batch, as TRL 1.16's ``GRPOTrainer``.

Everything here runs on the WHOLE global batch, which every rank has after an all-gather of the rewards
(a prompt's group of ``num_generations`` completions may sit on several ranks): rows are group-major, rows
``[g·G, (g+1)·G)`` being prompt ``g``'s completions, and each rank then takes its own rows of the result.
Being computed from the same numbers in the same order on every rank, the advantages are bitwise equal on
all ranks and for any number of ranks.

TRL's rules (``_generate_and_score_completions``, multi_objective_aggregation = sum_then_normalize):
  reward   = Σ_f weight_f · reward_f (NaN rewards count 0), NaN when every function answered None
  A        = reward − nanmean(group's rewards), then / (std + 1e-4) unless scale_rewards = none, where std is
             the group's (scale_rewards = group) or the whole batch's (batch), both nan-aware with Bessel's
             correction; an unscorable completion (reward NaN) gets A = 0.
normalize_then_sum: each function's rewards are standardised within the group first, then weighted, summed and
standardised over the batch (GDPO).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
#: TRL's constant in the denominator of the scaled advantages
STD_EPS = 1e-4


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (NaN with fewer than 2 values), as TRL's."""
    d = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=d, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=d, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=d, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std if keepdim else std.squeeze(d) if dim is not None else std.reshape(())


@dataclass
class Advantages:
    advantages: torch.Tensor  # (rows,) of the whole global batch; a rank takes its own rows
    rewards: torch.Tensor  # (rows,) the weighted sums, NaN where every function answered None
    metrics: dict[str, float]  # TRL's names: reward, reward_std, rewards/<fn>/mean|std, frac_reward_zero_std


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale: str = "group", aggregation: str = "sum_then_normalize",
                     names: Sequence[str] | None = None) -> Advantages:
    """Advantages of every completion of the global batch from ``rewards_per_func`` (rows, functions), NaN
    where a function answered None (``rewards.score``), rows group-major; ``weights`` (functions,)."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards {scale!r} is not one of {', '.join(SCALES)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    rows, funcs = rewards_per_func.shape
    if rows % num_generations:
        raise ValueError(f"{rows} completions are not whole groups of {num_generations}")
    r = rewards_per_func.float()
    w = weights.to(r.device, torch.float32)
    unscorable = torch.isnan(r).all(dim=1)
    G = num_generations

    def per_row(stat: torch.Tensor) -> torch.Tensor:
        return stat.repeat_interleave(G, dim=0)

    if aggregation == "sum_then_normalize":
        rewards = (r * w).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = per_row(torch.nanmean(rewards.view(-1, G), dim=1))
        if scale == "batch":
            std = nanstd(rewards).expand_as(rewards) if rows > 1 else torch.zeros_like(rewards)
        else:  # group, and none (whose std only feeds frac_reward_zero_std)
            std = per_row(nanstd(rewards.view(-1, G), dim=1)) if G > 1 else torch.zeros_like(rewards)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + STD_EPS)
    else:
        grouped = r.view(-1, G, funcs)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if G > 1 else torch.zeros_like(mean_k)
        rewards = (((grouped - mean_k) / (std_k + STD_EPS)).view(-1, funcs) * w).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rows > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + STD_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    zero_std = torch.isclose(std, torch.zeros_like(std))

    logged = (r * w).nansum(dim=1)
    logged[unscorable] = torch.nan
    metrics: dict[str, float] = {}
    for j, name in enumerate(names if names is not None else [f"reward_{j}" for j in range(funcs)]):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(r[:, j]).item()
        metrics[f"rewards/{name}/std"] = nanstd(r[:, j]).item()
    metrics["reward"] = torch.nanmean(logged).item()
    metrics["reward_std"] = nanstd(logged).item()
    metrics["frac_reward_zero_std"] = zero_std.float().mean().item()
    return Advantages(advantages, logged, metrics)


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """TRL's ``completions/*`` metrics of the global batch: lengths in tokens (EOS included) and whether each
    completion was cut by the length limit (its last token is no EOS)."""
    n = torch.tensor(list(lengths), dtype=torch.float32)
    cut = torch.tensor(list(truncated), dtype=torch.bool)
    ended = n[~cut] if bool((~cut).any()) else torch.zeros(1)
    return {
        "completions/mean_length": n.mean().item(),
        "completions/min_length": n.min().item(),
        "completions/max_length": n.max().item(),
        "completions/clipped_ratio": cut.float().mean().item(),
        "completions/mean_terminated_length": ended.mean().item(),
        "completions/min_terminated_length": ended.min().item(),
        "completions/max_terminated_length": ended.max().item(),
    }
