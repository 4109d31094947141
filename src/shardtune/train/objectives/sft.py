"""Supervised fine-tuning: the mean next-token loss over every target token of the batch.

A global batch's loss is the sum of the cross-entropy of all its target tokens divided by their number,
however the batch is split over ranks and micro-batches: each forward contributes
``sum(its token losses) / global target count``. ``mean_token_accuracy`` (TRL's name): the share of
target tokens that are the model's most likely token.
"""

from __future__ import annotations

import torch

from shardtune.train.data.batch import Batcher, Forward
from shardtune.train.data.sft import SFT
from shardtune.train.loss_head import Scores
from shardtune.train.objectives.base import Objective, Terms


class Sft(Objective):
    name = "sft"
    records = SFT
    metrics = ("mean_token_accuracy",)

    def norms(self, batcher: Batcher, items: list[int]) -> dict[str, float]:
        return {"targets": float(sum(e.targets for e in batcher.sequences(items)))}

    def terms(self, scores: Scores, fwd: Forward, batcher: Batcher, norms: dict[str, float],
              reference: torch.Tensor | None) -> Terms:
        loss = -scores.logps.sum() / norms["targets"]
        return Terms(loss, scores.correct.sum().float().reshape(1))

    def summarize(self, sums: list[float], norms: dict[str, float]) -> dict[str, float]:
        return {"mean_token_accuracy": sums[0] / norms["targets"]}
