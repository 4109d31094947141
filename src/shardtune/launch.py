"""Starting the worker processes: torch's elastic launcher, as torchrun uses it.

Workers are fresh ``python -m shardtune.train CONFIG`` processes (nothing of the caller is forked
or pickled), so the same path serves the command line, torchrun-less scripts and notebooks.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from pathlib import Path

from shardtune.config import Config, ParallelConfig, write_yaml


class WorkerError(RuntimeError):
    """A worker process failed; the message names the rank and its error."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(err: Exception) -> str:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(err, ChildFailedError):
        return str(err)
    rank, failure = min(err.failures.items(), key=lambda kv: kv[1].timestamp or 0)
    data = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
    if isinstance(data, dict) and data.get("message"):
        stack = data.get("extraInfo", {}).get("py_callstack", "")
        lines = [line for line in stack.strip().splitlines() if line.strip()]
        return f"rank {rank} failed: {data['message']}\n" + "\n".join(lines[-12:])
    return f"rank {rank} failed with exit code {failure.exitcode} ({failure.message})"


def launch_workers(parallel: ParallelConfig, module: str, args: list[str]) -> None:
    """Run ``python -m module *args`` on ``parallel.nproc`` local workers joined into one process group.

    Raises WorkerError naming the first rank that failed; the elastic agent stops the others.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    p = parallel
    if p.nnodes > 1:
        endpoint, backend, rdzv_configs = p.rdzv_endpoint, "static", {"rank": p.node_rank}
        os.environ.setdefault("MASTER_ADDR", endpoint.rsplit(":", 1)[0])
    else:
        endpoint, backend, rdzv_configs = f"127.0.0.1:{_free_port()}", "c10d", {}
    launch_config = LaunchConfig(
        min_nodes=p.nnodes, max_nodes=p.nnodes, nproc_per_node=p.nproc, run_id=f"shardtune-{uuid.uuid4().hex[:8]}",
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs, max_restarts=0,
        monitor_interval=0.2, start_method="spawn",
    )
    try:
        elastic_launch(launch_config, sys.executable)("-m", module, *args)
    except ChildFailedError as err:
        raise WorkerError(_describe(err)) from None


def launch(cfg: Config) -> dict:
    """Run the fine-tune described by ``cfg`` on ``cfg.parallel.nproc`` local workers; return the summary."""
    out = Path(cfg.output.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    write_yaml(cfg, config_path)
    summary_path = out / "summary.json"
    if summary_path.exists():
        summary_path.unlink()  # never report an older run's result as this one's
    if under_torchrun():
        from shardtune.train import run

        return run(cfg)
    launch_workers(cfg.parallel, "shardtune.train", [str(config_path)])
    if not summary_path.is_file():
        if cfg.parallel.node_rank > 0:
            return {}  # rank 0, on node 0, writes the summary
        raise WorkerError(f"the workers finished but wrote no {summary_path}")
    return json.loads(summary_path.read_text())
