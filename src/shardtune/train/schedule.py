"""The optimizer and its learning-rate schedule, and the length of a run."""

from __future__ import annotations

import math

import torch

from shardtune.config import Config


def total_steps(cfg: Config, n_items: int) -> int:
    """``n_items``: an epoch's items, what --batch-size counts: records, pairs under a preference objective,
    completions under GRPO (``Objective.epoch_items``)."""
    if cfg.train.steps:
        return cfg.train.steps
    return max(1, math.ceil((cfg.train.epochs or 1.0) * n_items / cfg.train.batch_size))


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine down to ``min_ratio`` × peak at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def optimizer_and_schedule(cfg: Config, params: list[torch.nn.Parameter], steps: int
                           ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW on the trainable weights, with linear warmup (--warmup-steps, default 10% of the steps, at most
    100) and cosine decay to --min-lr-ratio × --lr over ``steps``."""
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = cfg.train.warmup_steps if cfg.train.warmup_steps is not None else min(100, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, steps, warmup, cfg.train.min_lr_ratio))
    return optimizer, scheduler
