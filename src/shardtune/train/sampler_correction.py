"""TRL 1.16's vLLM importance-sampling correction: the ratio of the trainer's to the sampler's probabilities.

A vLLM server samples with its own kernels and precision (and, under --quantize nf4, a 16-bit base), so the
probability it gave a sampled token differs from the trainer's. TRL reweights GRPO's per-token loss by
π_old / π_vLLM of the sampled tokens: the old policy's log-probs (the trainer's, computed after sampling,
even with num_iterations 1) against the log-probs vLLM reported (``logprobs: 0`` of the completions API).
As ``GRPOTrainer._generate_and_score_completions``, on a generation batch's (rows, width) tables:

  d = (old − sampling) · mask, a NaN (a token vLLM did not score) set to 0
  token_*     ρ = exp(d)                        (rows, width)
  sequence_*  ρ = exp(Σ_t d)                    (rows, 1): a sum over the tokens, not a mean
  *_truncate  ρ = clamp(ρ, C_min, C_max)
  *_mask      ρ = 0 where ρ < C_min or ρ > C_max

(a bound of None is none). grpo_loss.grpo_terms multiplies each token's policy loss by ρ (before the KL term
is added; vespo takes log ρ into its sequence weight instead). Metrics as TRL's, over the whole batch:
``sampling/sampling_logp_difference/mean|max`` (|old − sampling| over the loss mask's scored tokens) and
``sampling/importance_sampling_ratio/min|mean|max`` (per token over the mask, or per sequence over every row);
0 where there is nothing to measure, as TRL.

With --off-policy-mask-threshold the sampler's log-probs are asked for even with the correction off, and kept
(``sampler_table``) for grpo_loss.off_policy_mask, which measures against them (as TRL, whose vLLM path always
has them).
"""

from __future__ import annotations

import math

import torch

from shardtune.config.options import VLLM_IS_MODES, GrpoConfig

MODES = VLLM_IS_MODES[1:]  # without "off"


def wants_sampler_logps(g: GrpoConfig) -> bool:
    """Whether a vLLM sampler is asked for its log-prob of each sampled token: for the importance-sampling
    correction, or for off-policy masking, which (as TRL's) measures the policy's drift from the sampler itself."""
    return g.vllm_importance_sampling != "off" or g.off_policy_mask_threshold is not None


def importance_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
                     low: float | None = None, high: float | None = 3.0) -> tuple[torch.Tensor, dict[str, float]]:
    """(the ratio ρ: (rows, width) for token_* modes, (rows, 1) for sequence_*; its metrics) from the old
    policy's and the sampler's (rows, width) log-probs of the sampled tokens and the loss mask (module doc)."""
    if mode not in MODES:
        raise ValueError(f"vLLM importance sampling mode {mode!r} is not one of {', '.join(MODES)}")
    old, sampling, mask = old.float(), sampling.to(old.device).float(), mask.to(old.device).float()
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    sequence = mode.startswith("sequence")
    ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence else diff)
    if mode.endswith("truncate"):
        if low is not None or high is not None:
            ratio = torch.clamp(ratio, min=low, max=high)
    else:
        lo = -math.inf if low is None else low
        hi = math.inf if high is None else high
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)

    scored = mask.bool()
    delta = (old - sampling).abs()
    delta = delta[scored & ~delta.isnan()]
    flat = ratio.flatten() if sequence else ratio[scored]

    def stat(x: torch.Tensor, fn) -> float:
        return float(fn(x)) if x.numel() else 0.0

    metrics = {"sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
               "sampling/sampling_logp_difference/max": stat(delta, torch.max),
               "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
               "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
               "sampling/importance_sampling_ratio/max": stat(flat, torch.max)}
    return ratio, metrics


def sampler_table(logps: list[list[float | None] | None], width: int) -> torch.Tensor:
    """(rows, width) float32 of each row's sampled-token log-probs, right-padded with 0; None (a token the sampler
    did not score) becomes NaN, which ``importance_ratio`` leaves uncorrected, as TRL."""
    table = torch.zeros(len(logps), width)
    for i, row in enumerate(logps):
        assert row is not None, "every completion needs the sampler's log-probs"
        table[i, :len(row)] = torch.tensor([math.nan if x is None else float(x) for x in row], dtype=torch.float32)
    return table
