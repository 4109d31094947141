"""The interface every objective implements, so that the recipe has one step and one evaluate.

An objective says what an item of its data is (``records``: a record, or a preference pair of two
sequences), what a global batch's loss is divided by (``norms``: known to every rank without
communication, since every rank has tokenized all the data), each forward's share of that loss and
the sums behind its metrics (``terms``, from the loss head's per-token log-probabilities), and what it
needs of the reference model (``reference_of``; ``uses_reference``). The loss of a batch is the sum of
its forwards' terms over every rank, whatever the split: N ranks train exactly like one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtune.train.data.batch import Batcher, Forward
from shardtune.train.data.records import RecordFormat
from shardtune.train.loss_head import Scores


@dataclass
class Terms:
    """One forward's share of a batch: its part of the loss (with grad) and its metric sums (detached)."""

    loss: torch.Tensor  # scalar
    sums: torch.Tensor  # (len(objective.metrics),) in fp32, to be added over forwards and ranks


class Objective:
    """What is learned from a batch; subclasses fill in the parts."""

    name: str = ""
    records: RecordFormat
    #: step metrics (TRL's names), each ``summarize``d from the sums of ``terms``
    metrics: tuple[str, ...] = ()
    #: whether ``terms`` needs the reference model's values (``reference_of``) of each forward
    uses_reference: bool = False
    #: whether a step's items are sampled from the policy before the step (GRPO's rollouts, train/rollout.py)
    #: rather than read from the data: the data then holds prompts, and ``--batch-size`` counts completions
    generates: bool = False
    #: the temperature the loss head scores at (GRPO: the sampling temperature, as TRL)
    temperature: float = 1.0

    def epoch_items(self, records: int) -> int:
        """Items an epoch of ``records`` data records makes (what --epochs multiplies): one per record."""
        return records // self.per_item

    def records_per_batch(self, batch_size: int) -> int:
        """Data records one global batch of --batch-size items draws."""
        return batch_size

    @property
    def per_item(self) -> int:
        """Sequences per item: one per record, two per preference pair."""
        return self.records.per_record

    def norms(self, batcher: Batcher, items: list[int]) -> dict[str, float]:
        """What the loss of the batch ``items`` (all ranks) is divided by."""
        raise NotImplementedError

    def terms(self, scores: Scores, fwd: Forward, batcher: Batcher, norms: dict[str, float],
              reference: torch.Tensor | None) -> Terms:
        """``fwd``'s share of the batch's loss and metric sums; ``reference``: ``reference_of`` for ``fwd``
        under the reference model when ``uses_reference``."""
        raise NotImplementedError

    def summarize(self, sums: list[float], norms: dict[str, float]) -> dict[str, float]:
        """The metrics from the sums of ``terms`` over a whole batch (or validation set)."""
        raise NotImplementedError

    def reference_of(self, scores: Scores, fwd: Forward) -> torch.Tensor:
        """What the objective keeps of the reference model's scores of ``fwd``, one row per item."""
        raise NotImplementedError(f"--objective {self.name} has no reference model")

    def rows_per_forward(self, micro_batch: int) -> int:
        """Sequences of up to --seq-len one forward computes for a micro-batch of ``micro_batch`` items
        (packed, a row of per_item × --seq-len holds the same tokens). A reference forward runs under
        no_grad and keeps no activations, so the policy's forward is the one whose memory counts."""
        return micro_batch * self.per_item
