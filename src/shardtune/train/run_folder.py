"""What ``--out`` already holds decides whether a run may start there: nothing finished is lost.

A finished run (``summary.json``, ``adapter/``) or an interrupted one that kept checkpoints is only
continued (``--resume``) or replaced on request (``--overwrite``); ``--resume`` with no checkpoint
over a previous run's files is refused, since it could only start again at step 0 and replace them.
An empty or new ``--out`` with ``--resume`` starts at step 0 (a scheduler that passes ``--resume`` on
every start, the first one included, relies on it). ``--resume`` of a run that finished all its steps
is refused too: it would run no step and replace the real run's ``summary.json`` with a no-op's.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from shardtune.config import Config, ConfigError
from shardtune.train.checkpoint_files import META, checkpoints_dir, find_latest
from shardtune.train.metrics import read_metrics

log = logging.getLogger("shardtune")


def _previous_run(out: Path) -> list[str]:
    """The files under ``out`` a new run would replace."""
    found = [name for name in ("summary.json", "adapter") if (out / name).exists()]
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    return found


def check_run_folder(cfg: Config) -> None:
    """Refuse a start that would replace a previous run's results without being asked to."""
    out = Path(cfg.output.out)
    if cfg.output.resume and cfg.output.overwrite:
        raise ConfigError("options 'resume' and 'overwrite' contradict each other: --resume continues the run in "
                          f"{out}, --overwrite replaces it; give one")
    if not out.is_dir():
        return
    latest = find_latest(out)
    previous = _previous_run(out)
    if cfg.output.resume:
        if latest is None and previous:
            raise ConfigError(
                f"option 'resume': {out} holds no complete checkpoint to resume from, only a previous run's "
                f"{', '.join(previous)} (runs keep checkpoints with --save-every N); starting again at step 0 "
                "would replace them. Choose another --out, or pass --overwrite instead of --resume to start over")
        if latest is not None and (out / "metrics.jsonl").is_file():
            read_metrics(out / "metrics.jsonl")  # a damaged line is named now; a torn last line is dropped later
        return
    if cfg.output.overwrite:
        return
    finished = "summary.json" in previous
    if finished or latest is not None:
        what = "a finished run (summary.json, adapter/)" if finished else f"checkpoints of a run ({latest.name})"
        # --resume only where a checkpoint is: without one it is refused (above), so it is not offered
        resume = "Pass --resume to continue it from its newest checkpoint, " if latest else \
            "It kept no checkpoint to continue from (--save-every N keeps some). Pass "
        raise ConfigError(f"option 'out': {out} holds {what}; a new run there would replace it. {resume}"
                          "--overwrite to replace it, or choose another --out")


def clear_for_overwrite(cfg: Config) -> None:
    """With ``--overwrite``: drop the replaced run's checkpoints, so that a later ``--resume`` never
    continues the old run's state; its adapter and summary stay until the new run replaces them."""
    root = checkpoints_dir(Path(cfg.output.out))
    if cfg.output.overwrite and root.is_dir():
        log.warning("--overwrite: deleting the previous run's checkpoints in %s", root)
        shutil.rmtree(root)


def check_not_finished(cfg: Config, steps: int) -> None:
    """Refuse ``--resume`` of a run that finished: its ``summary.json`` counts ``steps`` or more and no
    checkpoint was written after it (a later run under --overwrite may have written some). Such a resume
    runs no step and would replace the finished run's summary with a no-op's timings and peaks."""
    out = Path(cfg.output.out)
    summary_file = out / "summary.json"
    if not cfg.output.resume or not summary_file.is_file():
        return
    try:
        done = json.loads(summary_file.read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return  # not a summary this check can read: the resume goes on, and replaces it when it ends
    latest = find_latest(out)
    if not isinstance(done, int) or done < steps or latest is None:
        return
    try:
        saved_at = float(json.loads((latest / META).read_text()).get("saved_at", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        saved_at = 0.0
    if saved_at > summary_file.stat().st_mtime:
        return  # checkpointed after that summary was written: a newer run, not finished
    raise ConfigError(
        f"option 'resume': the run in {out} has finished all its {done} steps (summary.json, adapter/): there is "
        f"nothing to resume{f' (this run would end at step {steps})' if steps < done else ''}, and nothing was "
        "changed. To train further, resume with a larger --steps (or --epochs); to start again, pass --overwrite "
        "instead of --resume, or choose another --out")


def adapter_run_options(adapter: str | Path | None) -> dict:
    """The options of the fine-tune that wrote ``adapter`` (OUT/adapter): its OUT/config.yaml, or {} for an
    adapter that is not a run's (or whose config.yaml cannot be read)."""
    import yaml

    if not adapter:
        return {}
    try:
        options = yaml.safe_load((Path(adapter).parent / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return options if isinstance(options, dict) else {}
