"""Never finish "successfully" on garbage: a non-finite loss or gradient norm, or weights blown up by an
update, end the run at that step, non-zero.

Except under fp16's loss scaling (``--dtype fp16``, train/scaling.py), where an inf/NaN gradient with a
finite loss is the dynamic scaler at work: it grows the scale until the scaled gradients overflow,
skips that step on every rank and halves the scale. Such a step is skipped and counted
(``skipped_steps`` and ``loss_scale`` in metrics.jsonl); only ``MAX_OVERFLOWS_IN_A_ROW`` of them in
a row (the scale has then collapsed: even unscaled the gradients overflow fp16) or a non-finite
loss (the forward itself overflowed) is a divergence.

Both values are global (the loss is all-reduced, the norm is over every rank's shard), so every rank
reaches the same verdict at the same step without communicating, and none is left waiting. The check
runs before the optimizer step: the weights stay those of the last good step, no checkpoint or
adapter is written from NaN weights, and the newest checkpoint is left as it is.

A gradient norm of exactly 0 right after an optimizer step whose gradient was not 0 means that update
blew the LoRA weights up (a far too large --lr saturates every output): the loss stays finite, nothing
is learned any more, and an adapter written from these weights would be garbage (lora_B of 1e30). The
run ends there as for a non-finite loss; the checkpoints written from that update on hold the blown-up
weights and are deleted, so the newest one left (and named, with the command that resumes from it)
is the last good one. A gradient of 0 with a loss of exactly 0 is no such sign: GRPO's step has nothing
to learn when every group's completions were rewarded alike (all advantages 0), and a run of them is said
as that, not as a sign of a bad --lr. A run in which every step was such a step ends with the adapter it
started from (a fresh LoRA's B = 0, or the --init-adapter weights): ``refuse_no_op`` stops it non-zero
before an adapter that changes nothing is written.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from shardtune.config import FLAGS, LoraConfig
from shardtune.errors import ShardtuneError
from shardtune.train.checkpoint_files import discard_checkpoints, find_latest, resume_command

log = logging.getLogger("shardtune")

#: fp16: overflowing steps in a row that end the run. From the scaler's initial 2^16 that many halvings
#: leave a scale of 2^-4: the gradients overflow fp16 even unscaled, and no step would ever be taken.
MAX_OVERFLOWS_IN_A_ROW = 20

# Steps in a row with a gradient norm of exactly 0 before saying so: one can happen, several mean
# the model has collapsed (e.g. a far too large --lr saturating every output) and learns nothing more.
ZERO_GRAD_STEPS = 3


class Diverged(ShardtuneError, RuntimeError):
    """Training produced a non-finite loss or gradient norm; the message names the step and what to do."""


class LearnedNothing(ShardtuneError, RuntimeError):
    """The run ended with an adapter that changes nothing (``refuse_no_op``); the message says what can cause it."""


def refuse_no_op(tensors: Mapping[str, torch.Tensor], lora: LoraConfig, objective: str, steps: int,
                 start: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise LearnedNothing where the adapter about to be written changes nothing the run started from.

    A fresh LoRA: every ``lora_B`` still exactly 0 (B starts at zero), so B·A adds nothing to any layer. Only
    where B is all that decides it: without DoRA's magnitudes, trained biases or --lora-modules-to-save.
    From --init-adapter (``start``: its tensors, keyed as ``tensors``): every tensor exactly the starting one,
    in the dtype written, so the adapter is the one given. Either way every step's gradient was exactly 0 (Adam
    moves a weight only by a gradient): the run learned nothing, and such an adapter is not written.
    ``tensors``: the full adapter, the same on every rank (a gather), so every rank raises alike."""
    if lora.init_adapter:
        if start is None or not all(k in start and torch.equal(t, start[k].to(t.dtype)) for k, t in tensors.items()):
            return
        what = f"every weight is exactly the one --init-adapter {lora.init_adapter} started from"
    else:
        if lora.variant != "lora" or lora.bias != "none" or lora.modules_to_save:
            return
        bs = [t for k, t in tensors.items() if "lora_B" in k]
        if not bs or any(bool(t.any()) for t in bs):
            return
        what = "every lora_B weight is still exactly 0, so the adapter would change no layer"
    why = ("every group's completions were rewarded alike at every step, so every advantage was 0 (a constant "
           "reward, a task no completion of the base solves yet, or every completion masked by "
           "--mask-truncated-completions): give rewards that tell a group's completions apart, or more steps"
           if objective == "grpo" else "every step's gradient was exactly 0")
    raise LearnedNothing(f"the run learned nothing in its {steps} step(s): {what}; {why}. No adapter was written "
                         "(metrics.jsonl shows each step)")


class TrainingGuard:
    """``check(step, loss, grad_norm)`` after each backward: raises Diverged, or warns about zero gradients,
    or (fp16, ``scaler`` enabled) says that the scaler skips the step."""

    def __init__(self, out: Path, lr: float, is_main: bool, lora_alpha: float | None = None,
                 scaler: ShardedGradScaler | None = None) -> None:
        self.out, self.lr, self.is_main, self.lora_alpha = Path(out), lr, is_main, lora_alpha
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.zero_run = 0
        self.zero_loss_run = 0  # ... of which the loss was exactly 0 too
        self.last_norm: float | None = None
        self.skipped = 0  # fp16: steps the scaler skipped (gradient overflow), this run
        self.overflow_run = 0  # ... of them in a row, up to the last step

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """``step`` counts from 1, as metrics.jsonl does. True: an fp16 overflow, which the scaler's
        ``step`` skips (on every rank: the norm is global, as the scaler's found-inf is)."""
        overflow = self.scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm)
        if overflow:
            self.skipped += 1
            self.overflow_run += 1
            if self.overflow_run < MAX_OVERFLOWS_IN_A_ROW:
                return True
            self._diverged(step, [f"the fp16 gradients overflowed at {self.overflow_run} steps in a row, the last "
                                  f"at a loss scale of {self.scaler.get_scale():g}: no scale works (--dtype bf16, "
                                  "where the GPU has it, needs no loss scaling)"])
        self.overflow_run = 0
        bad = [f"{name} is {value}" for name, value in (("the loss", loss), ("the gradient norm", grad_norm))
               if not math.isfinite(value)]
        if bad:
            self._diverged(step, bad)
        # the update of the step before did it; unless the loss is 0 too: a step with nothing to learn (GRPO:
        # every group's completions rewarded alike, so every advantage is 0)
        if grad_norm == 0 and self.last_norm and loss != 0:
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
        self.zero_loss_run = self.zero_loss_run + 1 if grad_norm == 0 and loss == 0 else 0
        if self.zero_loss_run == ZERO_GRAD_STEPS and self.is_main:  # nothing to learn: no sign of a bad --lr
            log.warning("the loss and the gradient norm have been exactly 0 for %d steps in a row (steps %d-%d): "
                        "these batches had nothing to learn (GRPO: every group's completions were rewarded alike, "
                        "so every advantage was 0); rewards that tell a group's completions apart give a gradient",
                        ZERO_GRAD_STEPS, step - ZERO_GRAD_STEPS + 1, step)
        elif self.zero_run == ZERO_GRAD_STEPS and self.is_main and self.lora_alpha == 0:
            log.warning("the gradient norm has been exactly 0 for %d steps in a row (steps %d-%d): --lora-alpha 0 "
                        "scales every LoRA update to nothing, so nothing is learned; give --lora-alpha > 0 "
                        "(e.g. twice --lora-r)", ZERO_GRAD_STEPS, step - ZERO_GRAD_STEPS + 1, step)
        elif self.zero_run == ZERO_GRAD_STEPS and self.is_main:
            log.warning("the gradient norm has been exactly 0 for %d steps in a row (steps %d-%d): the model "
                        "learns nothing more; a far too large --lr (now %g) can do this", ZERO_GRAD_STEPS,
                        step - ZERO_GRAD_STEPS + 1, step, self.lr)
        return False

    def _diverged(self, step: int, bad: list[str]) -> None:
        raise Diverged(f"training diverged at step {step}: {' and '.join(bad)} (--lr {self.lr:g}); stopped "
                       f"before the optimizer step, and no adapter was written; {self._kept(step)}")

    def _kept(self, before: int) -> str:
        """What is left to resume from: the newest complete checkpoint of a step before ``before``."""
        latest = find_latest(self.out, before=before)
        if latest is None:
            return "no checkpoint was written before it (--save-every N keeps some): start again with a smaller --lr"
        return (f"the newest complete checkpoint, {latest}, is kept; resume from it with a smaller --lr: "
                f"{resume_command(self.out)} --lr …")

    def fields(self) -> dict[str, float]:
        """What metrics.jsonl records of the loss scaling after each step (fp16 only): the steps skipped
        so far and the scale the next step uses."""
        if self.scaler is None:
            return {}
        return {"skipped_steps": self.skipped, "loss_scale": self.scaler.get_scale()}
