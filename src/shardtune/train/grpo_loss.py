"""GRPO's loss family on per-token log-probs, as TRL 1.16's ``GRPOTrainer._compute_loss``, in sums.

Inputs per micro-batch (rows = completions, time = completion tokens, fp32): the policy's log-probs of the
sampled tokens (with grad; at the sampling temperature, i.e. log_softmax(logits / T)), the old policy's
(``None`` when the batch is used once: the ratio is then exp(logp − logp.detach()) = 1, gradients flowing
as in TRL), the reference's (base model, adapter off; ``None`` when beta = 0), the advantages (rows,) and
the loss mask (completion tokens, 0 on padding and on truncated completions when they are masked).

Per token, with r = π/π_old (token level) or exp(mean over the sequence of log r) (sequence level, GSPO),
A the advantage, ε_low = epsilon, ε_high = epsilon_high (default epsilon):
  grpo bnpo dr_grpo dapo luspo  −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)   (r capped at delta if set)
  cispo                         −min(r, ε_high).detach() · A · logπ
  sapo                          −σ(τ·(r − 1))·4/τ · A,  τ = sapo_temperature_pos if A > 0 else _neg
  vespo                         −φ(w)·A·logπ,  φ(w) = e^λ·w^k·e^(−λw) (no grad), w the sequence ratio
  plus beta · k3 KL:            (exp(ref − logπ) − (ref − logπ) − 1) · r  (the · r: use_bias_correction_kl)
With a vLLM sampler's importance-sampling ratio ρ (train/sampler_correction.py; per token or per sequence) the
policy term above is multiplied by ρ before the KL term is added (vespo: log ρ joins its sequence weight's log
w instead), as TRL's ``vllm_importance_sampling_correction``.

Off-policy sequence masking (TRL's ``off_policy_mask_threshold`` δ, DeepSeek-V3.2 eq. 9; ``off_policy_mask``):
a completion with a negative advantage whose mean over its tokens of log π_sampler − log π (no grad) exceeds δ
gets no policy term (its KL term stays). π_sampler is what sampled it: a vLLM sampler's reported log-probs
(unscored NaN tokens count 0) when given, else the old policy's, else (num_iterations 1, no vLLM) the policy
itself, detached: the difference is then 0 and nothing is masked, as in TRL.

Aggregation: each loss is ``Σ_rows weight_row · Σ_t loss_t · mask_t`` with GLOBAL counts in the weights, so
that adding the sums of every micro-batch of every rank gives the loss of the whole optimizer step, exactly
(up to summation order), whatever the split. The counts are those of the optimizer step's global batch:
  grpo, sapo          1 / (row's tokens · global rows)          mean over sequences of per-sequence means
  dr_grpo             1 / (global rows · max_completion_length)
  dapo, cispo, vespo  1 / global tokens                        one mean over every token of the batch
  luspo               1 / global rows                          mean over sequences of per-sequence sums
  bnpo                1 / (micro-batch tokens · micro-batches)  mean over micro-batches of their token means
TRL divides by the same numbers (its per-rank / accumulation-step factors multiply out to these), so one
process with one micro-batch gives TRL's loss and gradients. bnpo is TRL's "local batch" normalisation: its
value depends on how the batch is cut into micro-batches (not on the ranks, if the micro-batches are the
same rows); dapo's "global tokens" is TRL's ``num_items_in_batch`` when one generation batch feeds one
optimizer step (TRL's default; with steps_per_generation > gradient_accumulation_steps TRL uses the
generation batch's tokens / steps instead).

Metrics (TRL's names) come back as sums, minima and maxima to all-reduce, then divide: they are exact over
the global batch (TRL logs the mean of per-micro-batch values, the same with one micro-batch per rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardtune.config import ConfigError
from shardtune.config.options import GRPO_LOSSES

LOSS_TYPES = GRPO_LOSSES
DEFAULT_LOSS = "dapo"  # TRL 1.16's default
IS_LEVELS = ("token", "sequence")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO-clip family


@dataclass(frozen=True)
class GRPOSettings:
    """The loss's knobs, named and defaulted as TRL's ``GRPOConfig``."""

    loss_type: str = DEFAULT_LOSS
    beta: float = 0.0  # KL coefficient; 0: no reference forward
    epsilon: float = 0.2  # lower clip bound: 1 − epsilon
    epsilon_high: float | None = None  # upper clip bound 1 + epsilon_high (cispo: the ratio's cap); None: epsilon
    delta: float | None = None  # two-sided GRPO: the ratio capped at delta (INTELLECT-2)
    importance_sampling_level: str = "token"  # or "sequence" (GSPO)
    max_completion_length: int = 256  # dr_grpo's constant
    use_bias_correction_kl: bool = True  # the KL term times the ratio (TRL's default)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None  # δ of off-policy sequence masking; None: off

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"GRPO loss {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ConfigError(f"importance sampling level {self.importance_sampling_level!r} is not one of "
                              f"{', '.join(IS_LEVELS)}")
        for name in ("beta", "epsilon"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"GRPO {name} must be a finite number >= 0, got {value}")
        if self.epsilon_high is not None and not (math.isfinite(self.epsilon_high) and self.epsilon_high >= 0):
            raise ConfigError(f"GRPO epsilon_high must be a finite number >= 0, got {self.epsilon_high}")
        if self.delta is not None and not (math.isfinite(self.delta) and self.delta > 1):
            raise ConfigError(f"GRPO delta must be a finite number > 1 (the ratio's cap), got {self.delta}")
        threshold = self.off_policy_mask_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
            raise ConfigError(f"GRPO off_policy_mask_threshold must be a finite number > 0, got {threshold}")
        if self.max_completion_length < 1:
            raise ConfigError(f"max_completion_length must be >= 1, got {self.max_completion_length}")

    @property
    def eps_low(self) -> float:
        return self.epsilon

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class Counts:
    """The optimizer step's global batch, over all ranks and micro-batches: what the loss divides by."""

    rows: int  # completions
    tokens: int  # loss-mask tokens
    micro_batches: int = 1  # bnpo: how many micro-batches the global batch is cut into (ranks × accumulation)

    @staticmethod
    def of(mask: torch.Tensor, micro_batches: int = 1) -> Counts:
        """The counts of a global batch held whole (the 1-process case, and tests)."""
        return Counts(mask.size(0), int(mask.sum().item()), micro_batches)


@dataclass
class StepMetrics:
    """Metrics of micro-batches, to add up locally, all-reduce across ranks, then read with ``values``."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> float64 [numerator, denominator]
    mins: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> float64 scalar, +inf: none
    maxs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> float64 scalar, −inf: none

    def add(self, other: StepMetrics) -> StepMetrics:
        """This micro-batch's metrics and ``other``'s, as one."""
        def merge(a: dict, b: dict, op: Callable) -> dict:
            return {k: op(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
        return StepMetrics(merge(self.sums, other.sums, torch.add), merge(self.mins, other.mins, torch.minimum),
                           merge(self.maxs, other.maxs, torch.maximum))

    def all_reduce(self, reduce: Callable[[torch.Tensor, str], None]) -> None:
        """Reduce across ranks in place: ``reduce(tensor, op)`` with op "sum", "min" or "max" (e.g. a wrapper
        of ``dist.all_reduce``); one call per op, names sorted so every rank packs them alike."""
        for table, op in ((self.sums, "sum"), (self.mins, "min"), (self.maxs, "max")):
            names = sorted(table)
            if not names:
                continue
            packed = torch.stack([table[k] for k in names])
            reduce(packed, op)
            for k, v in zip(names, packed):
                table[k] = v

    def values(self) -> dict[str, float]:
        """name -> value: sums as numerator / denominator (NaN for 0 / 0), extremes NaN when there were none."""
        out = {k: (v[0] / v[1]).item() if v[1] > 0 else math.nan for k, v in self.sums.items()}
        for k, v in {**self.mins, **self.maxs}.items():
            out[k] = v.item() if math.isfinite(v.item()) else math.nan
        return dict(sorted(out.items()))


@dataclass
class GRPOTerms:
    loss: torch.Tensor  # scalar with grad: this micro-batch's share of the optimizer step's loss
    metrics: StepMetrics


def _row_weights(settings: GRPOSettings, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """(rows, 1) weights that turn Σ_t loss·mask into this micro-batch's share of the global loss."""
    rows = float(max(counts.rows, 1))
    t = settings.loss_type
    if t in ("grpo", "sapo"):
        return 1.0 / (mask.sum(-1, keepdim=True).clamp(min=1.0) * rows)
    if t == "dr_grpo":
        return mask.new_full((mask.size(0), 1), 1.0 / (rows * settings.max_completion_length))
    if t in ("dapo", "cispo", "vespo"):
        return mask.new_full((mask.size(0), 1), 1.0 / max(counts.tokens, 1))
    if t == "luspo":
        return mask.new_full((mask.size(0), 1), 1.0 / rows)
    assert t == "bnpo"
    return (1.0 / (mask.sum().clamp(min=1.0) * counts.micro_batches)).expand(mask.size(0), 1)


@torch.no_grad()
def _gamma_weights(settings: GRPOSettings, advantages: torch.Tensor, log_ratio: torch.Tensor,
                   mask: torch.Tensor, is_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's φ(w) per sequence (rows, 1), as TRL's ``get_gamma_weights``; ``is_ratio``: a vLLM sampler's
    per-token ratio, whose clamped logs join the sequence's (unmasked, as TRL's)."""
    lower = math.log(1e-8)
    seq_log_ratio = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        seq_log_ratio = seq_log_ratio + torch.log(is_ratio).clamp(lower, 20.0).sum(-1, keepdim=True)
    log_w = seq_log_ratio.clamp(lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(nonneg, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """(rows, 1): 0 for a completion to drop (advantage < 0 and its mean per-token log π_sampler − log π over the
    mask above ``threshold``), 1 otherwise; as TRL's ``get_off_policy_mask`` (``advantages``: (rows, 1))."""
    kl = torch.nan_to_num(sampling.to(logps) - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def _masked(x: torch.Tensor, mask: torch.Tensor, per_sequence: bool = False) -> torch.Tensor:
    """[Σ x·mask, Σ mask] over tokens, or for per-sequence values (rows, 1) [Σ x, rows], float64 (TRL's
    ``global_masked_mean``)."""
    x, mask = x.detach().double(), mask.double()
    if per_sequence:
        return torch.stack([x.sum(), torch.tensor(float(x.size(0)), dtype=x.dtype, device=x.device)])
    return torch.stack([(x * mask).sum(), mask.sum()])


def _seq_means(x: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """Per-sequence means (rows,), NaN for a sequence without tokens (TRL's ``masked_seq_mean``)."""
    if per_sequence:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def grpo_terms(settings: GRPOSettings, logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
               counts: Counts, old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
               entropies: torch.Tensor | None = None, is_ratio: torch.Tensor | None = None,
               sampling_logps: torch.Tensor | None = None) -> GRPOTerms:
    """This micro-batch's loss (a sum with global normalisers, see the module's text) and metrics.

    ``logps``, ``mask``, ``old_logps``, ``ref_logps``, ``entropies``: (rows, time); ``advantages``: (rows,).
    ``entropies`` (optional) only feed the ``entropy`` metric. ``is_ratio``: a vLLM sampler's importance-sampling
    ratio, (rows, time) or (rows, 1) (train/sampler_correction.py); None: no correction. ``sampling_logps``: the
    vLLM sampler's own log-probs (rows, time), which off-policy masking measures against (default: the old
    policy's)."""
    if settings.beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs the reference's log-probs")
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if settings.importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)

    kl = None
    if settings.beta != 0.0:
        assert ref_logps is not None
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        if settings.use_bias_correction_kl:
            kl = kl * coef_1

    t = settings.loss_type
    lo, hi = settings.eps_low, settings.eps_high
    phi = None
    if t == "cispo":
        per_token = -torch.clamp(coef_1, max=hi).detach() * adv * logps
    elif t in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
        capped = coef_1 if settings.delta is None else torch.clamp(coef_1, max=settings.delta)
        per_token = -torch.min(capped * adv, coef_2 * adv)
    elif t == "sapo":
        tau = torch.where(adv > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    else:
        assert t == "vespo"
        phi = _gamma_weights(settings, adv, log_ratio, mask, is_ratio)
        per_token = -phi * adv * logps
    if settings.off_policy_mask_threshold is not None:
        sampling = old if sampling_logps is None else sampling_logps
        per_token = per_token * off_policy_mask(adv, logps, sampling, mask, settings.off_policy_mask_threshold)
    if is_ratio is not None and t != "vespo":
        per_token = per_token * is_ratio.to(per_token.dtype)
    if kl is not None:
        per_token = per_token + settings.beta * kl
    loss = (per_token * mask * _row_weights(settings, mask, counts)).sum()

    metrics = StepMetrics()
    if kl is not None:
        metrics.sums["kl"] = _masked(kl, mask)
    if entropies is not None:
        metrics.sums["entropy"] = _masked(entropies, mask)
    seq = settings.importance_sampling_level == "sequence"  # the ratio is then (rows, 1)
    if t in CLIPPED:
        low = ((coef_1 < 1 - lo) & (adv < 0)).to(logps.dtype)
        high = ((coef_1 > 1 + hi) & (adv > 0)).to(logps.dtype)
        metrics.sums["clip_ratio/low_mean"] = _masked(low, mask, seq)
        metrics.sums["clip_ratio/high_mean"] = _masked(high, mask, seq)
        metrics.sums["clip_ratio/region_mean"] = _masked(torch.maximum(low, high), mask, seq)
        low_seq, high_seq = _seq_means(low, mask, seq).double(), _seq_means(high, mask, seq).double()
        inf = torch.tensor(math.inf, dtype=torch.float64, device=logps.device)
        metrics.mins["clip_ratio/low_min"] = torch.where(low_seq.isnan(), inf, low_seq).min().detach() \
            if low_seq.numel() else inf
        metrics.maxs["clip_ratio/high_max"] = torch.where(high_seq.isnan(), -inf, high_seq).max().detach() \
            if high_seq.numel() else -inf
    elif t == "cispo":
        metrics.sums["cispo_clip_ratio"] = _masked(((coef_1 > hi) & (adv > 0)).to(logps.dtype), mask, seq)
    elif t == "vespo":
        assert phi is not None
        metrics.sums["vespo/phi_seq_mean"] = _masked(phi, mask, per_sequence=True)
    return GRPOTerms(loss, metrics)


def loss_mask(lengths: torch.Tensor, truncated: torch.Tensor, width: int, mask_truncated: bool = False) -> torch.Tensor:
    """(rows, width) float mask of completion tokens (right-padded rows of ``lengths`` tokens); with
    ``mask_truncated`` (TRL's mask_truncated_completions) a truncated completion has none."""
    positions = torch.arange(width, device=lengths.device)
    mask = positions.unsqueeze(0) < lengths.unsqueeze(1)
    if mask_truncated:
        mask = mask & ~truncated.to(torch.bool).unsqueeze(1)
    return mask.float()
