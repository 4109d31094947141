"""``shardtune finetune``'s launch: write the run's configuration, start the training workers, read the summary."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from shardtune.config import Config, write_yaml
from shardtune.runtime.workers import Stopped, WorkerError, launch_workers, under_torchrun


def launch(cfg: Config) -> dict:
    """Run the fine-tune described by ``cfg`` on ``cfg.parallel.nproc`` local workers; return the summary.

    Multi-node: node 0 alone writes ``config.yaml`` and (its rank 0) ``summary.json`` under ``--out``;
    the other nodes hand their workers a private copy of the configuration and return ``{}``.
    """
    out = Path(cfg.output.out)
    config_path, summary_path = out / "config.yaml", out / "summary.json"
    # under torchrun every rank of every node gets here: RANK is global
    first = cfg.parallel.node_rank == 0 and int(os.environ.get("RANK", "0")) == 0
    if first:
        out.mkdir(parents=True, exist_ok=True)
        write_yaml(cfg, config_path)
        summary_path.unlink(missing_ok=True)  # never report an older run's result as this one's
    if under_torchrun():
        from shardtune.train.recipe import run

        return run(cfg)
    private = None
    if not first:  # --out may be shared with node 0 (whose config.yaml it is) or not exist here yet
        private = Path(tempfile.mkdtemp(prefix="shardtune-node-"))
        config_path = private / "config.yaml"
        write_yaml(cfg, config_path)
    try:
        launch_workers(cfg.parallel, "shardtune.train", [str(config_path)])
    except Stopped as err:
        from shardtune.train.stop import stop_message

        message = stop_message(err.signum, out, cfg.parallel.nnodes, cfg.parallel.node_rank)
        raise Stopped(err.signum, message) from None
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
    if not first:
        return {}  # rank 0, on node 0, writes the summary
    if not summary_path.is_file():
        raise WorkerError(f"the workers finished but wrote no {summary_path}")
    return json.loads(summary_path.read_text())
