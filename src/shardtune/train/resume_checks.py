"""Whether a checkpoint fits the run that would resume from it: the options that decide its tensors, the
base model and the training data; what a resume accepts, it returns as warnings.

Run by the launching process before any worker starts (``resume_point``) and again by rank 0 when the
workers resume (checkpoint.py), so that a refused resume changes nothing under ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardtune.config import FLAGS, FREE, MUST_MATCH, Config
from shardtune.model.directory import ModelDir
from shardtune.model.fingerprint import differences, model_fingerprint
from shardtune.runtime.files import fingerprint
from shardtune.train.checkpoint_files import META, CheckpointError, find_latest


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
