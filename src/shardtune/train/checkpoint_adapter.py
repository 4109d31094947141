"""``shardtune adapter-from-checkpoint``: the peft adapter held by one resumable checkpoint, in one process.

Reads only the LoRA tensors (whole, whatever the number of ranks that wrote them) and needs no base
weights; the adapter records the base model's fingerprint the checkpoint recorded (model/adapter_dir.py).
A run folder, or its checkpoints folder, given where one checkpoint is wanted is named as such, with
the checkpoints it holds.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardtune.model.directory import check_model_dir
from shardtune.model.fingerprint import differences, model_fingerprint
from shardtune.model.hub import base_model_name
from shardtune.runtime.failure import stage
from shardtune.runtime.outputs import CHECKPOINTS, STEP_DIR, check_output, claim_output
from shardtune.train.adapter import write_adapter
from shardtune.train.checkpoint_files import META, CheckpointError, checkpoint_problem, failure_reason


def adapter_from_checkpoint(path: Path, out: Path, model: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write the peft adapter held by resumable checkpoint ``path`` into ``out``.

    ``model`` replaces the base model path recorded in the adapter config (refused when the checkpoint
    records another base model). A non-empty ``out`` is replaced only with ``overwrite=True``, and never
    when it is (or holds) the checkpoint.
    """
    path = Path(path)
    inputs = (("checkpoint", path),)
    check_output(out, kind="dir", inputs=inputs, overwrite=overwrite, name="output directory")
    match = STEP_DIR.match(path.name)
    if path.is_dir() and not match and (folder := _run_folder(path)):
        raise CheckpointError(folder)
    problem = checkpoint_problem(path, int(match.group(1)) if match else None) if path.is_dir() else \
        "no such directory"
    if problem:
        raise CheckpointError(f"{path} is not a usable checkpoint: {problem}")
    meta = json.loads((path / META).read_text())
    reader = dcp.FileSystemReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    keys = {adapter_key: f"model.{name}" for adapter_key, name in meta["adapter_keys"].items()}
    missing = [k for k in keys.values() if k not in stored]
    if missing:
        raise CheckpointError(f"{path}: the checkpoint lacks {', '.join(missing[:5])}")
    config = json.loads((path / "adapter_config.json").read_text())
    if model is not None:
        _check_model(path, meta, model)
        config["base_model_name_or_path"] = base_model_name(str(model))
    tensors = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in keys.values()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(tensors, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as err:
            raise CheckpointError(f"reading checkpoint {path} failed: {failure_reason(err)}") from None
    with claim_output(out, kind="dir", command="adapter-from-checkpoint", inputs=inputs, overwrite=overwrite,
                      name="output directory") as out, stage("write"):
        return write_adapter({a: tensors[k] for a, k in keys.items()}, config, out, meta.get("model"))


def _run_folder(path: Path) -> str | None:
    """What to say when ``path`` is a run folder (or its checkpoints folder), not one checkpoint; else None."""
    root = path if path.name == CHECKPOINTS else path / CHECKPOINTS
    if root is not path and not ((path / "config.yaml").is_file() or root.is_dir()):
        return None
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))) \
        if root.is_dir() else []
    what = "the checkpoints folder of a run" if root is path else "a run folder"
    if not steps:
        run = root.parent if root is path else path
        adapter = f"; its finished adapter is {run / 'adapter'}" if (run / "adapter").is_dir() else ""
        return (f"{path} is {what}, not a checkpoint, and holds no checkpoints (a run keeps some with --save-every N)"
                f"{adapter}")
    listed = ", ".join(p.name for _, p in steps[-6:]) + (f" and {len(steps) - 6} older" if len(steps) > 6 else "")
    return (f"{path} is {what}, not a checkpoint: give one of its checkpoints ({listed}), e.g. the newest, "
            f"{steps[-1][1]}")


def _check_model(path: Path, meta: dict, model: str | Path) -> None:
    """Refuse a ``--model`` that is not the base model the checkpoint records (a local one: a Hub id is only named)."""
    if meta.get("model") is None or not Path(model).expanduser().is_dir():
        return
    other, _ = differences(meta["model"], model_fingerprint(check_model_dir(model)))
    if other:
        raise CheckpointError(f"option --model {model} is another base model than checkpoint {path} was trained on: "
                              f"{other}. Leave --model out (the run's is recorded), or give that base")
