"""Resumable checkpoints of a run, written atomically: only LoRA (trainable) state, never the frozen base.

``Checkpointer`` saves and restores them (collectives: every rank writes and reads its own shards); the
layout on disk and finding the newest complete one are checkpoint_files.py's, whether one fits this
run is resume_checks.py's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardtune.config import Config
from shardtune.errors import ShardtuneError
from shardtune.model.directory import ModelDir
from shardtune.model.fingerprint import model_fingerprint
from shardtune.parallel import Strategy
from shardtune.runtime.files import fingerprint, output_error, replace_dir
from shardtune.runtime.outputs import STEP_DIR
from shardtune.train.adapter import peft_config_dict
from shardtune.train.checkpoint_files import (
    EXTRA,
    MARKER,
    META,
    CheckpointError,
    checkpoints_dir,
    failure_reason,
    find_latest,
)
from shardtune.train.resume_checks import check_resumable

log = logging.getLogger("shardtune")


@dataclass
class TrainState:
    """The running totals of a run; ``step`` is the number of optimizer steps done (the next to run)."""

    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    first_loss: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None

    def add(self, loss: float, tokens: int, seconds: float) -> None:
        self.step += 1
        self.tokens += tokens
        self.train_seconds += seconds
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss


class Checkpointer:
    """Saves and restores a run's resumable state: LoRA weights, optimizer, scheduler, RNG, data position."""

    def __init__(self, cfg: Config, model: nn.Module, strategy: Strategy, keys: dict[str, str],
                 optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 model_dir: ModelDir, scaler: torch.amp.GradScaler | None = None, extra: object | None = None) -> None:
        """``extra``: an object with ``state_dict()`` / ``load_state_dict(state)`` whose state goes with each
        checkpoint (the same on every rank: rank 0 writes it)."""
        self.cfg, self.model, self.strategy = cfg, model, strategy
        self.extra = extra
        self.keys, self.names = keys, list(keys.values())
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.worker = strategy.worker
        self.root = checkpoints_dir(Path(cfg.output.out))
        # Hashed once, by the rank that writes the metadata: what --resume compares data and model against.
        self._data = fingerprint(cfg.data.train) if self.worker.is_main and cfg.data.train else None
        self._model = model_fingerprint(model_dir) if self.worker.is_main else None

    def due(self, step: int) -> bool:
        every = self.cfg.output.save_every
        return bool(every) and step % every == 0

    def _state_dict(self) -> dict:
        """The trainable parameters and the optimizer state, as shards where the model is sharded."""
        options = StateDictOptions(ignore_frozen_params=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        model_sd = {k: v for k, v in model_sd.items() if k in self.names}  # no buffers either
        if set(model_sd) != set(self.names):
            missing = sorted(set(self.names) - set(model_sd))
            raise CheckpointError(f"the model's state dict lacks trainable parameters: {missing[:5]}")
        return {"model": model_sd, "optim": optim_sd}

    def save(self, state: TrainState) -> Path:
        """Write ``checkpoints/step-N`` (N = ``state.step``); a collective."""
        started = time.perf_counter()
        final, tmp = self.root / f"step-{state.step}", self.root / f".step-{state.step}.tmp"
        if self.worker.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        try:
            (tmp / "rng").mkdir(parents=True, exist_ok=True)  # by every rank: multi-node needs a shared --out
            dcp.save(self._state_dict(), storage_writer=dcp.FileSystemWriter(str(tmp)))
            rng = {"cpu": torch.get_rng_state()}
            if self.worker.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.worker.device)
            torch.save(rng, tmp / "rng" / f"rank-{self.worker.rank}.pt")
        except (Exception, CheckpointException) as err:  # DCP's own error derives from BaseException only
            # A full disk fills it no further: the half-written checkpoint goes, the complete ones stay.
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_error(err, tmp) from None
        dist.barrier()  # every rank's files are written
        if self.worker.is_main:
            config = peft_config_dict(self.model, self.strategy, self.cfg.model.path)
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            meta = {"step": state.step, "world_size": self.worker.world_size, "state": asdict(state),
                    "scheduler": self.scheduler.state_dict(), "options": self.cfg.flat(),
                    "adapter_keys": self.keys, "data": self._data, "model": self._model, "saved_at": time.time(),
                    "extra": self.extra is not None}
            if self.scaler is not None and self.scaler.is_enabled():  # fp16's loss scale continues too
                meta["loss_scaler"] = self.scaler.state_dict()
            (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
            if self.extra is not None:
                torch.save(self.extra.state_dict(), tmp / EXTRA)
            with open(tmp / MARKER, "w") as f:
                os.fsync(f.fileno())
            replace_dir(tmp, final)
            self._prune()
            log.info("checkpoint %s written in %.2f s", final, time.perf_counter() - started)
        dist.barrier()
        return final

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop leftovers of interrupted writes."""
        complete = sorted((int(m.group(1)), p) for p in self.root.iterdir()
                          if (m := STEP_DIR.match(p.name)) and (p / MARKER).is_file())
        for _, path in complete[:-self.cfg.output.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(".step-*.tmp"):
            shutil.rmtree(path, ignore_errors=True)

    def resume(self) -> TrainState:
        """Load the newest complete checkpoint into model, optimizer, scheduler and RNG; a collective.

        Returns the state to continue from (a fresh one, with a warning, when there is none).
        """
        out = self.root.parent
        path = find_latest(out) if self.worker.is_main else None
        path = _broadcast(path)  # one rank decides, so that all load the same one
        if path is None:
            if self.worker.is_main:  # legal: a scheduler passes --resume on every start (run_folder.py)
                log.info("nothing to resume in %s: starting at step 0", out)
            return TrainState()
        meta = json.loads((path / META).read_text())
        refused = None
        if self.worker.is_main:  # one rank decides and all follow: none is left waiting for another
            try:
                for message in check_resumable(self.cfg, path, meta, self._data, self._model):
                    log.warning("%s", message)
            except CheckpointError as err:
                refused = str(err)
        refused = _broadcast(refused)
        if refused:
            raise CheckpointError(refused)
        sd = self._state_dict()  # allocates the optimizer state to load into
        try:
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
        except (Exception, CheckpointException) as err:  # checked beforehand: only damage made since lands here
            raise CheckpointError(f"loading checkpoint {path} failed: {failure_reason(err)}") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(strict=False, ignore_frozen_params=True))
        self.scheduler.load_state_dict(meta["scheduler"])
        if self.extra is not None and (path / EXTRA).is_file():
            self.extra.load_state_dict(torch.load(path / EXTRA, weights_only=True))
        follow_this_schedule(self.scheduler, self.cfg.train.lr)
        if self.scaler is not None and self.scaler.is_enabled() and "loss_scaler" in meta:
            self.scaler.load_state_dict(meta["loss_scaler"])
        rng_file = path / "rng" / f"rank-{self.worker.rank}.pt"
        if meta["world_size"] == self.worker.world_size and rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.worker.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.worker.device)
        else:
            log.info("checkpoint written by %d ranks, resumed on %d: the dropout RNG starts afresh",
                     meta["world_size"], self.worker.world_size)
        log.info("resumed from %s (step %d)", path, meta["step"])
        return TrainState(**meta["state"])


def follow_this_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """Resume on this run's learning-rate schedule from the first resumed step: the checkpoint gives the
    step only; the peak (--lr) and the shape (--steps or --epochs, --warmup-steps, --min-lr-ratio: the
    scheduler's lambda, built from this run's options) are this run's.

    The scheduler's saved state holds the old peak and the old schedule's last rate, which the first
    resumed step would otherwise use before the new schedule took over at the second (a run resumed with
    a smaller --lr, as a divergence advises, kept its old peak altogether). Unchanged options give
    exactly the rates of an uninterrupted run.
    """
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    scheduler.last_epoch -= 1
    scheduler.step()  # this step's rate, recomputed from this run's lambda and peak


def _write_error(err: BaseException, tmp: Path) -> ShardtuneError:
    """The OSError behind a failed checkpoint write (DCP wraps each rank's), as an error naming the path."""
    causes = [err, err.__cause__, *(pair[0] for pair in getattr(err, "failures", {}).values())]
    for cause in causes:
        if isinstance(cause, OSError):
            return output_error(cause, tmp)
    return CheckpointError(f"writing checkpoint {tmp} failed: {failure_reason(err)}")


def _broadcast(value: object) -> object:
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
