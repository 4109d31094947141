"""Never finish "successfully" on garbage: a non-finite loss or gradient norm, or weights blown up by an
update, end the run at that step, non-zero.

Both values are global (the loss is all-reduced, the norm is over every rank's shard), so every rank
reaches the same verdict at the same step without communicating, and none is left waiting. The check
runs before the optimizer step: the weights stay those of the last good step, no checkpoint or
adapter is written from NaN weights, and the newest checkpoint is left as it is.

A gradient norm of exactly 0 right after an optimizer step whose gradient was not 0 means that update
blew the LoRA weights up (a far too large --lr saturates every output): the loss stays finite, nothing
is learned any more, and an adapter written from these weights would be garbage (lora_B of 1e30). The
run ends there as for a non-finite loss; the checkpoints written from that update on hold the blown-up
weights and are deleted, so the newest one left (and named, with the command that resumes from it)
is the last good one.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from shardtune.config import FLAGS
from shardtune.errors import ShardtuneError
from shardtune.train.checkpoint import discard_checkpoints, find_latest, resume_command

log = logging.getLogger("shardtune")

# Steps in a row with a gradient norm of exactly 0 before saying so: one can happen, several mean
# the model has collapsed (e.g. a far too large --lr saturating every output) and learns nothing more.
ZERO_GRAD_STEPS = 3


class Diverged(ShardtuneError, RuntimeError):
    """Training produced a non-finite loss or gradient norm; the message names the step and what to do."""


class TrainingGuard:
    """``check(step, loss, grad_norm)`` after each backward: raises Diverged, or warns about zero gradients."""

    def __init__(self, out: Path, lr: float, is_main: bool, lora_alpha: float | None = None) -> None:
        self.out, self.lr, self.is_main, self.lora_alpha = Path(out), lr, is_main, lora_alpha
        self.zero_run = 0
        self.last_norm: float | None = None

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        """``step`` counts from 1, as metrics.jsonl does."""
        bad = [f"{name} is {value}" for name, value in (("the loss", loss), ("the gradient norm", grad_norm))
               if not math.isfinite(value)]
        if bad:
            raise Diverged(f"training diverged at step {step}: {' and '.join(bad)} (--lr {self.lr:g}); stopped "
                           f"before the optimizer step, and no adapter was written; {self._kept(step)}")
        if grad_norm == 0 and self.last_norm:  # the update of the step before did it
            # checkpoint step-N holds the weights after N updates: from step-(step - 1) on they are blown up
            deleted = discard_checkpoints(self.out, step - 1) if self.is_main else []
            gone = (f" ({', '.join(p.name for p in deleted)}, written from the blown-up weights, "
                    f"{'was' if len(deleted) == 1 else 'were'} deleted)") if deleted else ""
            raise Diverged(
                f"training diverged at step {step}: the gradient norm is exactly 0 right after an optimizer step "
                f"whose gradient was not, so the update of step {step - 1} blew the LoRA weights up, saturating the "
                f"model's outputs (the loss, {loss:.4g}, stays finite but nothing is learned any more). --lr "
                f"{self.lr:g} is far too large (the default is {FLAGS['lr'][1].default:g}); stopped, and no adapter "
                f"was written{gone}; {self._kept(step - 1)}")
        self.last_norm = grad_norm
        self.zero_run = self.zero_run + 1 if grad_norm == 0 else 0
        if self.zero_run == ZERO_GRAD_STEPS and self.is_main and self.lora_alpha == 0:
            log.warning("the gradient norm has been exactly 0 for %d steps in a row (steps %d-%d): --lora-alpha 0 "
                        "scales every LoRA update to nothing, so nothing is learned; give --lora-alpha > 0 "
                        "(e.g. twice --lora-r)", ZERO_GRAD_STEPS, step - ZERO_GRAD_STEPS + 1, step)
        elif self.zero_run == ZERO_GRAD_STEPS and self.is_main:
            log.warning("the gradient norm has been exactly 0 for %d steps in a row (steps %d-%d): the model "
                        "learns nothing more; a far too large --lr (now %g) can do this", ZERO_GRAD_STEPS,
                        step - ZERO_GRAD_STEPS + 1, step, self.lr)

    def _kept(self, before: int) -> str:
        """What is left to resume from: the newest complete checkpoint of a step before ``before``."""
        latest = find_latest(self.out, before=before)
        if latest is None:
            return "no checkpoint was written before it (--save-every N keeps some): start again with a smaller --lr"
        return (f"the newest complete checkpoint, {latest}, is kept; resume from it with a smaller --lr: "
                f"{resume_command(self.out)} --lr …")
