"""A run's checkpoints on disk: where they are, which is the newest complete one, what is wrong with one.

Layout of ``OUT/checkpoints/step-N/`` (written by checkpoint.py's ``Checkpointer``):
  ``.metadata``, ``__*_*.distcp``   torch.distributed.checkpoint (DCP): the trainable parameters and
                                  AdamW's state, each rank writing its own shard (FSDP2 DTensors)
  ``rng/rank-K.pt``               every rank's torch RNG states (LoRA dropout)
  ``adapter_config.json``         peft's config, so that ``adapter-from-checkpoint`` needs no model
  ``extra.pt``                    what the objective keeps between steps (GRPO: the generation batch), if any
  ``checkpoint.json``             data position (``step``: the next step to run), world size, LR
                                  scheduler state, running totals, the run's options, adapter key names,
                                  the data's and the base model's fingerprints (what ``--resume`` checks)
  ``COMPLETE``                    written last: a directory without it is never resumed from
It is written as ``.step-N.tmp`` and renamed once every rank has finished writing, so a crash mid-write
leaves the previous checkpoints as they were. Nothing here is a collective; the launcher, the tools
and every rank use it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from shardtune.errors import ShardtuneError
from shardtune.runtime.outputs import CHECKPOINTS, STEP_DIR

log = logging.getLogger("shardtune")

MARKER, META, EXTRA = "COMPLETE", "checkpoint.json", "extra.pt"
_STEP_DIR = STEP_DIR  # OUT/checkpoints/step-N: named in runtime/outputs.py, whose rule keeps outputs out of it


class CheckpointError(ShardtuneError, RuntimeError):
    """A checkpoint that cannot be used; the message names it and says why."""


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
    import torch.distributed.checkpoint as dcp  # on use: the launcher seldom needs it (0.7 s to import)
    from torch.distributed.checkpoint.api import CheckpointException

    if not (path / MARKER).is_file():
        return f"no {MARKER} marker (its writing did not finish)"
    try:
        meta = json.loads((path / META).read_text())
        if step is not None and meta["step"] != step:
            return f"{META} says step {meta['step']}"
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except (Exception, CheckpointException) as err:  # any damage at all means: do not resume from it
        return f"unreadable ({type(err).__name__}: {err})"
    small = [path / "rng" / f"rank-{rank}.pt" for rank in range(int(meta.get("world_size", 0)))]
    small += [path / EXTRA] if meta.get("extra") else []  # recorded since checkpoints kept the objective's state
    return _short_file(path, metadata.storage_data or {}) or next(filter(None, map(_unloadable, small)), None)


def _unloadable(file: Path) -> str | None:
    """Why a small state file (a rank's RNG states, the objective's ``extra.pt``) cannot be loaded, or None: read
    whole now (kilobytes), so that the resume itself never fails on it halfway through."""
    import torch

    if not file.is_file():
        return f"its file {file} is missing"
    try:
        torch.load(file, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any damage at all means: do not resume from it
        return f"its file {file} is unreadable ({type(err).__name__})"
    return None


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


def failure_reason(err: BaseException) -> str:
    """One line for a DCP failure: its first rank's own exception (DCP's message embeds tracebacks). A rank that
    only lost a peer while writing says so in the collective library's own words, without its source location
    and advice (runtime/worker_failures ``lost_peer``): the launcher names the rank that failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    from shardtune.runtime.worker_failures import lost_peer

    failures = getattr(err, "failures", None)
    rank, cause = None, err
    if isinstance(err, CheckpointException) and failures:
        rank, (cause, *_) = min(failures.items())
    lost = lost_peer(str(cause))
    said = f"lost another rank ({lost})" if lost else f"{type(cause).__name__}: {cause}"
    return said if rank is None else f"rank {rank}: {said}"
