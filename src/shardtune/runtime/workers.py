"""Starting worker processes with torch's elastic launcher, as torchrun does, and naming the rank that failed.

Workers are fresh ``python -m MODULE ARGS`` processes (nothing of the caller is forked or pickled),
so the same path serves the command line, scripts and notebooks, for training and eval workers alike.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.config import ParallelConfig
from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


class WorkerError(ShardtuneError, RuntimeError):
    """A worker process failed; the message names the rank and its error."""


class WorkerCrash(WorkerError):
    """A worker raised an exception none of our checks foresaw; ``traceback`` holds its full text."""

    exit_code = 3

    def __init__(self, rank: int, message: str, traceback: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.message, self.traceback = rank, message, traceback


class RankTimeout(WorkerError):
    """The ranks that went on waited ``--collective-timeout`` for a rank that stopped responding."""


class Stopped(WorkerError):
    """SIGTERM or SIGINT stopped the run (sent to this launcher or to the workers); ``exit_code`` is 128 + signal."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"stopped by signal {signum}")
        self.signum, self.exit_code = int(signum), 128 + int(signum)


# On SIGTERM/SIGINT the elastic agent forwards the signal and waits this long before SIGKILL: time for
# the workers to finish their step and write a checkpoint.
STOP_TIMEOUT = int(os.environ.get("SHARDTUNE_STOP_TIMEOUT", "120"))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How a rank's error reads when it only lost a peer: a consequence, not the cause.
_PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited", "communicator was aborted")


def _stderr_tail(failure: ProcessFailure, log_dir: Path) -> list[str]:
    """The last non-empty lines a worker wrote to stderr."""
    tail: list[str] = []
    for path in log_dir.glob(f"**/attempt_*/{failure.local_rank}/stderr.log"):
        tail = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()][-12:]
    return tail


def _cause_first(failure: ProcessFailure, tail: list[str]) -> tuple[bool, bool, int]:
    """Sort key putting the failure that caused the others first.

    Timestamps alone mislead: they have whole seconds, and a rank that lost a peer (the peer killed by
    SIGKILL, say) fails in the same second; the agent's own SIGTERM to the survivors also counts as failing.
    A worker without an error file (not ours, or killed) shows the lost peer in its stderr only.
    """
    text = str(failure.message) + "\n".join(tail[-3:])
    return (failure.exitcode == -signal.SIGTERM, any(p in text for p in _PEER_LOST), failure.timestamp or 0)


def _ours(last_line: str) -> bool:
    """Whether a traceback's last line ("package.module.Class: message") is one of our user-facing errors."""
    import importlib

    qualified = last_line.split(":", 1)[0]
    module, _, name = qualified.rpartition(".")
    if not module.startswith("shardtune"):
        return False
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except Exception:  # whatever that module is, it is not one we can check
        return False
    return isinstance(cls, type) and issubclass(cls, ShardtuneError)


_TIMED_OUT = re.compile(r"timed out|timeout|watchdog caught collective", re.IGNORECASE)


def _silent_ranks(err: Exception, tails: dict[int, list[str]], world_size: int) -> list[int] | None:
    """The ranks the others waited for in vain, when every rank that failed did so by a collective's
    timeout (a rank stopped by SIGSTOP or a hung device fails in nothing: it is the one not listed)."""
    texts = {rank: str(f.error_file_data) + "\n".join(tails[rank]) for rank, f in err.failures.items()}
    timed_out = {rank for rank, text in texts.items() if _TIMED_OUT.search(text)}
    # The silent rank itself is either not listed or was killed by the agent's shutdown (a signal).
    others = {rank for rank in texts if rank not in timed_out}
    if not timed_out or any(err.failures[rank].exitcode >= 0 for rank in others):
        return None
    return sorted(set(range(world_size)) - timed_out)


def _describe(err: Exception, log_dir: Path, world_size: int = 0) -> WorkerError:
    """The error naming the first rank that failed, its message (and where its traceback goes)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(err, ChildFailedError):
        return WorkerError(str(err))
    tails = {rank: _stderr_tail(f, log_dir) for rank, f in err.failures.items()}
    silent = _silent_ranks(err, tails, world_size)
    if silent is not None:
        who = f"rank {', '.join(map(str, silent))}" if silent else "a rank of another node"
        waited = ", ".join(map(str, sorted(set(range(world_size)) - set(silent))))
        return RankTimeout(f"{who} stopped responding: rank(s) {waited} waited "
                           "--collective-timeout for it in a collective and gave up (a stopped or hung process, or a "
                           "hung device)")
    rank, failure = min(err.failures.items(), key=lambda item: _cause_first(item[1], tails[item[0]]))
    data = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
    if isinstance(data, dict) and data.get("message"):
        stack = data.get("extraInfo", {}).get("py_callstack", "")
        lines = [line for line in stack.strip().splitlines() if line.strip()]
        # The exception's own line follows the last frame (frames are indented; a message may span lines).
        last_frame = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=-1)
        if last_frame + 1 < len(lines) and _ours(lines[last_frame + 1]):
            # One of our errors: its message is written for the user, a traceback would only bury it.
            return WorkerError(f"rank {rank}: {data['message'].split(': ', 1)[-1]}")
        return WorkerCrash(rank, data["message"], stack)
    # Without an error file (a worker that is not ours, or one killed by a signal) its stderr tells.
    tail = tails[rank]
    cause = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {-failure.exitcode}"
    if failure.signal_name() != "<N/A>":
        cause = f"killed by {failure.signal_name()}"
    last = tail[-1].split("]: ", 1)[-1] if tail else ""
    return WorkerError(f"rank {rank} failed ({cause}){': ' + last if last else ''}"
                       + ("\n" + "\n".join(tail) if tail else ""))


class _Relay(threading.Thread):
    """Copies the workers' output files to this process's sys.stdout/sys.stderr as they grow.

    Workers write to files, not to our terminal, because in a notebook the kernel's file
    descriptors are not the cell's output: only ``sys.stdout`` reaches the user there.
    """

    def __init__(self, log_dir: Path) -> None:
        super().__init__(daemon=True, name="shardtune-relay")
        self.log_dir, self.done = log_dir, threading.Event()
        self.offsets: dict[Path, int] = {}

    def pump(self) -> None:
        for path in sorted(self.log_dir.glob("**/std*.log")):
            size = path.stat().st_size
            start = self.offsets.get(path, 0)
            if size > start:
                with path.open("rb") as f:
                    f.seek(start)
                    chunk = f.read(size - start)
                self.offsets[path] = size
                stream = sys.stderr if path.name == "stderr.log" else sys.stdout
                stream.write(chunk.decode("utf-8", "replace"))
                stream.flush()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.pump()

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.pump()


def run_id(parallel: ParallelConfig) -> str:
    """The id of the run this launcher belongs to: the same on every node of a multi-node run."""
    if parallel.nnodes > 1:
        return f"shardtune-{parallel.rdzv_endpoint}"  # every node must name the same run to meet in the store
    return f"shardtune-{uuid.uuid4().hex[:8]}"


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
        monitor_interval=0.2, start_method="spawn", shutdown_timeout=STOP_TIMEOUT,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    from shardtune.runtime.device import device_type
    from shardtune.runtime.distributed import LAUNCHER_PID
    from shardtune.runtime.memory import worker_malloc_env

    # Workers die with this process (distributed.die_with_parent). Tied to this run's id, so that the value,
    # inherited by anything this process starts later (a torchrun, say), is never taken for its launcher.
    previous_launcher = os.environ.get(LAUNCHER_PID)
    os.environ[LAUNCHER_PID] = f"{os.getpid()}:{launch_config.run_id}"
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # worker output is a file: flush it line by line
    # Each worker would otherwise start one compute thread per core: N workers on C cores then
    # oversubscribe them, which made a 2-rank CPU run 5x slower than 1 rank. (torchrun sets 1.)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // p.nproc)))
    previous_tunables = os.environ.get("GLIBC_TUNABLES")
    os.environ.update(worker_malloc_env(device_type(p.device)))
    relay = _Relay(log_dir)
    relay.start()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        elastic_launch(launch_config, sys.executable)("-m", module, *args)
    except SignalException as err:  # the agent has forwarded it and waited for the workers
        raise Stopped(err.sigval) from None
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes <= {128 + signal.SIGTERM, 128 + signal.SIGINT}:  # workers signalled directly stop this way
            raise Stopped(max(codes) - 128) from None
        raise _describe(err, log_dir, p.nproc * p.nnodes) from None
    except Exception as err:
        if p.nnodes > 1 and _TIMED_OUT.search(f"{type(err).__name__} {err}"):
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
        for name, previous in ((LAUNCHER_PID, previous_launcher), ("GLIBC_TUNABLES", previous_tunables)):
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous
