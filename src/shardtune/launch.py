"""``shardtune finetune``'s launch: take the run folder, write the run's configuration, start the workers.

Nothing under ``--out`` changes before the run is accepted (preflight, lock): a refused start leaves
the folder as it was. ``OUT/config.yaml`` holds the options as the user gave them, ``auto`` included,
so that ``--config OUT/config.yaml --resume`` decides again for the ranks it resumes on; what ``auto``
chose is the run plan's (``summary.json``'s ``run_plan``, the log). Workers read a private copy of
the decided configuration and the plan, never ``OUT/config.yaml``, which a user (or another run) may
edit. ``summary.json`` is only ever replaced by a new one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import traceback
from pathlib import Path

from shardtune.config import Config, write_yaml
from shardtune.errors import ShardtuneError
from shardtune.runplan import RunPlan
from shardtune.runtime.failure import stage, stage_of, unexpected
from shardtune.runtime.files import staged_file
from shardtune.runtime.lock import RunLock
from shardtune.runtime.signals import Interrupted
from shardtune.runtime.worker_failures import RankKilled, RankTimeout, Stopped, WorkerCrash, WorkerError
from shardtune.runtime.workers import launch_workers, run_id, under_torchrun
from shardtune.train.run_folder import clear_for_overwrite


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _write_config(cfg: Config, path: Path) -> None:
    with staged_file(path) as tmp:
        write_yaml(cfg, tmp)


def launch(cfg: Config, plan: RunPlan, asked: Config | None = None) -> dict:
    """Run the fine-tune described by ``cfg`` with its run ``plan`` (preflight) on ``cfg.parallel.nproc``
    local workers; return the summary. The workers receive the plan; they do not decide it again.
    ``asked``: the configuration as the user gave it, before preflight decided its ``auto`` options,
    written to ``OUT/config.yaml`` (default: ``cfg``).

    Multi-node: node 0 alone writes ``config.yaml`` and (its rank 0) ``summary.json`` under ``--out``;
    the other nodes hand their workers a private copy of the configuration and return ``{}``.
    """
    out = Path(cfg.output.out)
    asked = asked or cfg
    if under_torchrun():  # every rank gets here; rank 0 holds the run folder for the run
        from shardtune.train.recipe import run

        try:
            if int(os.environ.get("RANK", "0")) != 0:
                return run(cfg, plan)  # rank 0's plan replaces this one (recipe.run)
            with RunLock(out, os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")):
                clear_for_overwrite(cfg)
                _write_config(asked, out / "config.yaml")
                return run(cfg, plan)
        except Stopped as err:  # as below: the caller sees a KeyboardInterrupt
            raise Interrupted(err.signum, str(err)) from None

    with RunLock(out, run_id(cfg.parallel)) as lock:
        try:
            with stage("launch"):
                return _launch(cfg, plan, asked, lock.run_id)
        except WorkerCrash as err:  # an exception none of our checks foresaw, in a worker
            raise unexpected(f"rank {err.rank}", stage_of(err.traceback), err.message, err.traceback, out) from None
        except (RankTimeout, RankKilled) as err:  # a rank was lost: say where the run can continue from
            from shardtune.train.checkpoint_files import find_latest, resume_command

            latest = find_latest(out)
            raise type(err)(f"{err}; newest checkpoint: " + (
                f"{latest}. To continue, run: {resume_command(out, cfg.parallel.nnodes, cfg.parallel.node_rank)}"
                if latest else "none (--save-every N keeps some)")) from None
        except ShardtuneError:
            raise
        except Exception as err:  # the same, in this launching process
            raise unexpected("the launcher", stage_of(err), f"{type(err).__name__}: {err}", traceback.format_exc(),
                             out) from err


def _launch(cfg: Config, plan: RunPlan, asked: Config, run_name: str) -> dict:
    """The run, once ``--out`` is locked: config.yaml, the workers, the summary they wrote."""
    out = Path(cfg.output.out)
    summary_path = out / "summary.json"
    if cfg.parallel.node_rank == 0:
        clear_for_overwrite(cfg)
        _write_config(asked, out / "config.yaml")
    before = _identity(summary_path)
    private = Path(tempfile.mkdtemp(prefix="shardtune-run-"))
    try:
        write_yaml(cfg, private / "config.yaml")
        (private / "plan.json").write_text(json.dumps(plan.as_dict()))
        launch_workers(cfg.parallel, "shardtune.train", [str(private / "config.yaml"), str(private / "plan.json")],
                       run_name)
    except Stopped as err:  # a KeyboardInterrupt to the caller: ``except KeyboardInterrupt`` sees a Ctrl-C
        from shardtune.train.stop import stop_message

        message = stop_message(err.signum, out, cfg.parallel.nnodes, cfg.parallel.node_rank)
        raise Interrupted(err.signum, message) from None
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if cfg.parallel.node_rank > 0:
        return {}  # rank 0, on node 0, writes the summary (into an --out the nodes may share)
    if _identity(summary_path) in (None, before):  # never report an older run's result as this one's
        raise WorkerError(f"the workers exited with status 0 but wrote no new {summary_path}: something in a worker "
                          "ended it early without an error (code of yours it ran, such as a reward function, that "
                          "calls os._exit or kills its own process?); the run did not finish")
    return json.loads(summary_path.read_text())
