"""Starting worker processes with torch's elastic launcher, as torchrun does.

Workers run ``python -m MODULE ARGS`` in processes of their own, forked from a warm starter that
imported the libraries once (warm_start.py), never from the caller (nothing of it is forked or pickled),
so the same path serves the command line, scripts and notebooks, for training and eval workers alike.
Their environment is worker_env.py's (nothing is set in the caller's), their output is relayed as it
is written (output_relay.py), and a failure names the rank that caused it (worker_failures.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from pathlib import Path

from shardtune.config import ParallelConfig
from shardtune.runtime import warm_start
from shardtune.runtime.output_relay import OutputRelay
from shardtune.runtime.worker_env import kept_environ, starter_env, worker_command, worker_env
from shardtune.runtime.worker_failures import TIMED_OUT, Stopped, WorkerError, describe

# On SIGTERM/SIGINT the elastic agent forwards the signal and waits this long before SIGKILL: time for
# the workers to finish their step and write a checkpoint.
STOP_TIMEOUT = int(os.environ.get("SHARDTUNE_STOP_TIMEOUT", "120"))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def prestart(parallel: ParallelConfig) -> None:
    """Start the warm starter that ``launch_workers(parallel, ...)`` will fork the workers from, now: its
    imports then overlap the launcher's own checks (reading and tokenizing the data, planning) instead of
    following them. The launch reuses it while this process's environment stays as it is now."""
    if warm_start.warm() and not under_torchrun():
        warm_start.starter_address(starter_env(worker_env(parallel, "")))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_id(parallel: ParallelConfig) -> str:
    """The id of the run this launcher belongs to: the same on every node of a multi-node run."""
    if parallel.nnodes > 1:
        return f"shardtune-{parallel.rdzv_endpoint}"  # every node must name the same run to meet in the store
    return f"shardtune-{uuid.uuid4().hex[:8]}"


def _shutdown_timeout(launch_config: type) -> dict[str, int]:
    """How long the agent waits for stopped workers: a LaunchConfig field only from torch 2.12 on (the
    GPU images still ship 2.11, whose agent keeps its own 30 s)."""
    names = {f.name for f in dataclasses.fields(launch_config)}
    return {"shutdown_timeout": STOP_TIMEOUT} if "shutdown_timeout" in names else {}


def launch_workers(parallel: ParallelConfig, module: str, args: list[str], run: str | None = None) -> None:
    """Run ``python -m module *args`` on ``parallel.nproc`` local workers joined into one process group.

    Their output is relayed here; raises WorkerError naming the first rank that failed, after the
    elastic agent has stopped the others. ``run``: the run id (default: ``run_id(parallel)``).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    p = parallel
    log_dir = Path(tempfile.mkdtemp(prefix="shardtune-logs-"))
    if p.nnodes > 1:
        # torchrun's default for a fixed set of nodes: node 0 hosts the store at the endpoint.
        endpoint, backend = p.rdzv_endpoint, "static"
        # The other nodes must join within --collective-timeout, not torch's default of 10 minutes.
        rdzv_configs = {"rank": p.node_rank, "timeout": max(1, int(p.collective_timeout))}
    else:
        endpoint, backend, rdzv_configs = f"127.0.0.1:{free_port()}", "c10d", {}
    launch_config = LaunchConfig(
        min_nodes=p.nnodes, max_nodes=p.nnodes, nproc_per_node=p.nproc, run_id=run or run_id(p),
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs, max_restarts=0,
        monitor_interval=0.2, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL), **_shutdown_timeout(LaunchConfig),
    )
    entrypoint, command = worker_command(worker_env(p, launch_config.run_id), module, args)
    relay = OutputRelay(log_dir)
    relay.start()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with kept_environ():  # torch's launcher writes into os.environ
            elastic_launch(launch_config, entrypoint)(*command)
    except SignalException as err:  # the agent has forwarded it and waited for the workers
        raise Stopped(err.sigval) from None
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes <= {128 + signal.SIGTERM, 128 + signal.SIGINT}:  # workers signalled directly stop this way
            raise Stopped(max(codes) - 128) from None
        raise describe(err, log_dir, p.nproc * p.nnodes) from None
    except Exception as err:
        if p.nnodes > 1 and TIMED_OUT.search(f"{type(err).__name__} {err}"):
            raise WorkerError(
                f"node {p.node_rank}: the other nodes did not join the rendezvous at {p.rdzv_endpoint} within "
                f"--collective-timeout {p.collective_timeout:g} s: are they started, with the same --nnodes and "
                "--rdzv-endpoint, and can they reach it?") from None
        raise
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():  # the agent leaves its own handlers installed
                signal.signal(sig, handler)
        relay.stop()
        shutil.rmtree(log_dir, ignore_errors=True)

