"""Resumable checkpoints of a run, written atomically; only LoRA (trainable) state, never the frozen base.

A resumable checkpoint ``OUT/checkpoints/step-N/`` holds:
  ``.metadata``, ``__*_*.distcp``   torch.distributed.checkpoint (DCP): the trainable parameters and
                                  AdamW's state, each rank writing its own shard (FSDP2 DTensors)
  ``rng/rank-K.pt``               every rank's torch RNG states (LoRA dropout)
  ``adapter_config.json``         peft's config, so that ``adapter-from-checkpoint`` needs no model
  ``extra.pt``                    what the objective keeps between steps (GRPO: the generation batch), if any
  ``checkpoint.json``             data position (``step``: the next step to run), world size, LR
                                  scheduler state, running totals, the run's options, adapter key names,
                                  the data's and the base model's fingerprints (what ``--resume`` checks)
  ``COMPLETE``                    written last: a directory without it is never resumed from
It is written as ``.step-N.tmp`` and renamed by rank 0 once every rank has finished writing, so a
crash mid-write leaves the previous checkpoints as they were.
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

from shardtune.config import FLAGS, FREE, MUST_MATCH, Config
from shardtune.errors import ShardtuneError
from shardtune.model.directory import ModelDir
from shardtune.model.fingerprint import differences, model_fingerprint
from shardtune.parallel import Strategy
from shardtune.runtime.files import fingerprint, output_error, replace_dir
from shardtune.runtime.outputs import CHECKPOINTS, STEP_DIR
from shardtune.train.adapter import peft_config_dict

log = logging.getLogger("shardtune")

MARKER, META, EXTRA = "COMPLETE", "checkpoint.json", "extra.pt"
_STEP_DIR = STEP_DIR  # OUT/checkpoints/step-N: named in runtime/outputs.py, whose rule keeps outputs out of it


class CheckpointError(ShardtuneError, RuntimeError):
    """A checkpoint that cannot be used; the message names it and says why."""


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


def checkpoints_dir(out: Path) -> Path:
    return Path(out) / CHECKPOINTS


def resume_command(out: Path, nnodes: int = 1, node_rank: int = 0) -> str:
    """The command that continues the run; multi-node: this node's (config.yaml is node 0's)."""
    node = f" --node-rank {node_rank}" if nnodes > 1 else ""
    return f"shardtune finetune --config {Path(out) / 'config.yaml'}{node} --resume"


def find_latest(out: Path, before: int | None = None) -> Path | None:
    """The newest complete checkpoint under ``out`` (of a step before ``before``, when given); incomplete
    or unreadable ones are skipped, with a warning."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return None
    for tmp in sorted(root.glob(".step-*.tmp")):
        log.warning("skipping %s: a checkpoint whose writing never finished", tmp)
    found = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP_DIR.match(p.name)) and (before is None or int(m.group(1)) < before))
    for step, path in reversed(found):
        problem = checkpoint_problem(path, step)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def discard_checkpoints(out: Path, first: int) -> list[Path]:
    """Delete the checkpoints of step ``first`` and later (weights an update blew up, train/guard.py);
    return them. The older ones, written before, stay."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return []
    doomed = sorted((p for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and int(m.group(1)) >= first),
                    key=lambda p: int(p.name.split("-")[1]))
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def checkpoint_problem(path: Path, step: int | None) -> str | None:
    """Why ``path`` cannot be resumed from, or None.

    Decided from metadata and file sizes only, before any rank loads anything: a load that fails
    halfway may already have overwritten part of the model and optimizer state.
    """
    if not (path / MARKER).is_file():
        return f"no {MARKER} marker (its writing did not finish)"
    try:
        meta = json.loads((path / META).read_text())
        if step is not None and meta["step"] != step:
            return f"{META} says step {meta['step']}"
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except (Exception, CheckpointException) as err:  # any damage at all means: do not resume from it
        return f"unreadable ({type(err).__name__}: {err})"
    return _short_file(path, metadata.storage_data or {})


def _short_file(path: Path, storage: dict) -> str | None:
    """A data file that is missing or shorter than the bytes the checkpoint's metadata places in it."""
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"its data file {file} is missing"
        if file.stat().st_size < size:
            return f"its data file {file} is truncated ({file.stat().st_size} of {size} bytes)"
    return None


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
                    "adapter_keys": self.keys, "data": self._data, "model": self._model, "saved_at": time.time()}
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
                          if (m := _STEP_DIR.match(p.name)) and (p / MARKER).is_file())
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


def failure_reason(err: BaseException) -> str:
    """One line for a DCP failure: its first rank's own exception (DCP's message embeds tracebacks)."""
    failures = getattr(err, "failures", None)
    if isinstance(err, CheckpointException) and failures:
        rank, (cause, *_) = min(failures.items())
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(err).__name__}: {err}"


def check_resumable(cfg: Config, path: Path, meta: dict, data: dict | None, model: dict | None) -> list[str]:
    """Refuse to resume ``cfg`` from checkpoint ``path`` when its tensors, its base model or its data no
    longer fit.

    ``data`` and ``model`` are the training data's and the base model's fingerprints now. Returns what a
    resume accepts with a warning: the other options that changed, a base model stored in other dtypes.
    """
    saved, now = meta["options"], cfg.flat()
    # Each option's policy is declared with it in the schema (config/options.py, ``opt(..., resume)``).
    policy = {flag: f.metadata["resume"] for flag, (_, f) in FLAGS.items()}
    changed = {k: (saved.get(k), v) for k, v in now.items() if policy[k] != FREE and saved.get(k) != v}
    bad = {k: v for k, v in changed.items() if policy[k] == MUST_MATCH}
    if bad:
        raise CheckpointError(f"cannot resume from {path}: " + "; ".join(
            f"option '{k}' was {a!r}, now {b!r}" for k, (a, b) in bad.items())
            + " (these decide which tensors the checkpoint holds; use the old values or a new --out)")
    notes = [f"resuming from {path} with option '{k}' changed from {a!r} to {b!r}" for k, (a, b) in changed.items()]
    notes += _check_base_model(cfg, path, meta, model)
    before = meta.get("data")
    if before and data and (before["bytes"], before["sha256"]) != (data["bytes"], data["sha256"]):
        message = (f"the training data {data['path']} changed since checkpoint {path} was written "
                   f"({before['bytes']} bytes, sha256 {before['sha256'][:12]}…; now {data['bytes']} bytes, "
                   f"sha256 {data['sha256'][:12]}…)")
        if not cfg.output.allow_data_change:
            raise CheckpointError(f"cannot resume: {message}; the saved data position would point at other "
                                  "records. Restore the file, or pass --allow-data-change to continue anyway")
        notes.append(f"{message}; continuing (--allow-data-change)")
    return notes


def _check_base_model(cfg: Config, path: Path, meta: dict, now: dict | None) -> list[str]:
    """Refuse another base model than the checkpoint's (its LoRA tensors were trained on that one)."""
    before = meta.get("model")
    if before is None:  # written before checkpoints recorded it
        return [f"checkpoint {path} does not record its base model (an older shardtune wrote it): "
                f"--model {cfg.model.path} is assumed to be the one it was made from"]
    if now is None:
        return []
    other, stored = differences(before, now)
    if other:
        raise CheckpointError(
            f"cannot resume from {path}: it was made from another base model than --model {cfg.model.path}: "
            f"{other}. Resume with the model the checkpoint was made from (its run's --model was "
            f"{meta['options'].get('model')}), or train this one in a new --out")
    return [f"resuming from {path}: the base model is the same, but {stored}"] if stored else []


def resume_point(cfg: Config, model_dir: ModelDir) -> Path | None:
    """The checkpoint ``--resume`` will continue from (None: none), checked against ``cfg``, its base
    model and its data.

    Run once in the launching process, before any worker loads a weight, so that a refused resume
    changes nothing under ``--out``.
    """
    path = find_latest(Path(cfg.output.out))
    if path is not None:
        meta = json.loads((path / META).read_text())
        check_resumable(cfg, path, meta, fingerprint(cfg.data.train), model_fingerprint(model_dir))
    return path


def _broadcast(value: object) -> object:
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
