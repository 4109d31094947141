"""``shardtune finetune``'s launch: take the run folder, write the run's configuration, start the workers.

Nothing under ``--out`` changes before the run is accepted (preflight, lock): a refused start leaves
the folder as it was. Workers read a private copy of the configuration, never ``OUT/config.yaml``,
which a user (or another run) may edit. ``summary.json`` is only ever replaced by a new one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from shardtune.config import Config, write_yaml
from shardtune.runplan import RunPlan
from shardtune.runtime.files import output_error
from shardtune.runtime.lock import RunLock
from shardtune.runtime.workers import Stopped, WorkerError, launch_workers, run_id, under_torchrun


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _write_config(cfg: Config, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_yaml(cfg, tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise output_error(err, path) from None


def launch(cfg: Config, plan: RunPlan) -> dict:
    """Run the fine-tune described by ``cfg`` with its run ``plan`` (preflight) on ``cfg.parallel.nproc``
    local workers; return the summary. The workers receive the plan; they do not decide it again.

    Multi-node: node 0 alone writes ``config.yaml`` and (its rank 0) ``summary.json`` under ``--out``;
    the other nodes hand their workers a private copy of the configuration and return ``{}``.
    """
    out = Path(cfg.output.out)
    if under_torchrun():  # every rank gets here; rank 0 holds the run folder for the run
        from shardtune.train.recipe import run

        if int(os.environ.get("RANK", "0")) != 0:
            return run(cfg, plan)  # rank 0's plan replaces this one (recipe.run)
        with RunLock(out, os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")):
            _write_config(cfg, out / "config.yaml")
            return run(cfg, plan)

    run_name = run_id(cfg.parallel)
    summary_path = out / "summary.json"
    with RunLock(out, run_name):
        if cfg.parallel.node_rank == 0:
            _write_config(cfg, out / "config.yaml")
        before = _identity(summary_path)
        private = Path(tempfile.mkdtemp(prefix="shardtune-run-"))
        try:
            write_yaml(cfg, private / "config.yaml")
            (private / "plan.json").write_text(json.dumps(plan.as_dict()))
            launch_workers(cfg.parallel, "shardtune.train", [str(private / "config.yaml"), str(private / "plan.json")],
                           run_name)
        except Stopped as err:
            from shardtune.train.stop import stop_message

            message = stop_message(err.signum, out, cfg.parallel.nnodes, cfg.parallel.node_rank)
            raise Stopped(err.signum, message) from None
        finally:
            shutil.rmtree(private, ignore_errors=True)
    if cfg.parallel.node_rank > 0:
        return {}  # rank 0, on node 0, writes the summary (into an --out the nodes may share)
    if _identity(summary_path) in (None, before):  # never report an older run's result as this one's
        raise WorkerError(f"the workers finished but wrote no new {summary_path}")
    return json.loads(summary_path.read_text())
