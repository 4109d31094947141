"""Never finish "successfully" on garbage: a non-finite loss or gradient norm ends the run at that step.

Both values are global (the loss is all-reduced, the norm is over every rank's shard), so every rank
reaches the same verdict at the same step without communicating, and none is left waiting. The check
runs before the optimizer step: the weights stay those of the last good step, no checkpoint or
adapter is written from NaN weights, and the newest checkpoint is left as it is.

A gradient norm of exactly 0 right after an optimizer step whose gradient was not 0 is said at once:
that update blew the LoRA weights up (a far too large --lr saturates every output), the loss stays
finite and nothing is learned any more. Waiting a few steps to be sure would only waste them.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from shardtune.config import FLAGS
from shardtune.errors import ShardtuneError
from shardtune.train.checkpoint import find_latest, resume_command

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
        self.blown_up = False  # said once

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        """``step`` counts from 1, as metrics.jsonl does."""
        bad = [f"{name} is {value}" for name, value in (("the loss", loss), ("the gradient norm", grad_norm))
               if not math.isfinite(value)]
        if bad:
            latest = find_latest(self.out) if self.is_main else None
            keep = (f"the newest complete checkpoint, {latest}, is kept; resume from it with a lower --lr: "
                    f"{resume_command(self.out)} --lr …" if latest else "no checkpoint was written")
            raise Diverged(f"training diverged at step {step}: {' and '.join(bad)} (--lr {self.lr:g}); "
                           f"stopped before the optimizer step, and no adapter was written; {keep}")
        collapsed = grad_norm == 0 and bool(self.last_norm)  # the update of the step before did it
        self.last_norm = grad_norm
        if collapsed and not self.blown_up:
            self.blown_up = True
            if self.is_main:
                log.warning("step %d: the gradient norm is exactly 0 right after an optimizer step whose gradient "
                            "was not: that update blew the LoRA weights up, saturating the model's outputs (the "
                            "loss, %.4g, stays finite but nothing is learned any more). --lr %g is far too large: "
                            "start again with a smaller one (the default is %g)", step, loss, self.lr,
                            FLAGS["lr"][1].default)
        self.zero_run = self.zero_run + 1 if grad_norm == 0 else 0
        if self.blown_up:
            return  # said already, with its cause
        if self.zero_run == ZERO_GRAD_STEPS and self.is_main and self.lora_alpha == 0:
            log.warning("the gradient norm has been exactly 0 for %d steps in a row (steps %d-%d): --lora-alpha 0 "
                        "scales every LoRA update to nothing, so nothing is learned; give --lora-alpha > 0 "
                        "(e.g. twice --lora-r)", ZERO_GRAD_STEPS, step - ZERO_GRAD_STEPS + 1, step)
        elif self.zero_run == ZERO_GRAD_STEPS and self.is_main:
            log.warning("the gradient norm has been exactly 0 for %d steps in a row (steps %d-%d): the model "
                        "learns nothing more; a far too large --lr (now %g) can do this", ZERO_GRAD_STEPS,
                        step - ZERO_GRAD_STEPS + 1, step, self.lr)
