"""``shardtune finetune``'s launch: write the run's configuration, start the training workers, read the summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shardtune.config import Config, write_yaml
from shardtune.runtime.workers import Stopped, WorkerError, launch_workers, under_torchrun


def launch(cfg: Config) -> dict:
    """Run the fine-tune described by ``cfg`` on ``cfg.parallel.nproc`` local workers; return the summary."""
    out = Path(cfg.output.out)
    config_path, summary_path = out / "config.yaml", out / "summary.json"
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank gets here
        out.mkdir(parents=True, exist_ok=True)
        write_yaml(cfg, config_path)
        summary_path.unlink(missing_ok=True)  # never report an older run's result as this one's
    if under_torchrun():
        from shardtune.train.recipe import run

        return run(cfg)
    try:
        launch_workers(cfg.parallel, "shardtune.train", [str(config_path)])
    except Stopped as err:
        from shardtune.train.stop import stop_message

        raise Stopped(err.signum, stop_message(err.signum, out)) from None
    if not summary_path.is_file():
        if cfg.parallel.node_rank > 0:
            return {}  # rank 0, on node 0, writes the summary
        raise WorkerError(f"the workers finished but wrote no {summary_path}")
    return json.loads(summary_path.read_text())
