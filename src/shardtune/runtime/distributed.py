"""All process-group set-up in one place: backend, device per local rank, timeouts, teardown."""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtune.config import ConfigError
from shardtune.errors import ShardtuneError
from shardtune.runtime.device import backend, device_type, local_device, local_world_size
from shardtune.runtime.warm_start import LAUNCHER_PID

# A rank that dies or hangs must not leave the others waiting for the default 30 minutes: collectives give
# up after this long and the launcher then names the rank that went silent. A run's --collective-timeout
# replaces it; this default serves the workers started without a run's options (eval).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("SHARDTUNE_COLLECTIVE_TIMEOUT", "300")))


@dataclass(frozen=True)
class Worker:
    """This process's place in the run: its rank, the number of ranks, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1  # ranks on this node (LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def die_with_parent() -> None:
    """Make the kernel SIGKILL this worker when the process that started it dies (Linux).

    Torch's elastic agent puts every worker in a process group of its own, so when the launcher is
    SIGKILLed (an OOM killer, a notebook kernel restart) nothing else reaches the workers: they would
    live on, detached, holding memory and devices. A launcher that died before this call is caught
    by the re-check right after it: our launcher names itself; otherwise the parent turning into
    another process (init, a sub-reaper) shows it.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    launcher, _, run = os.environ.get(LAUNCHER_PID, "").partition(":")
    ours = launcher.isdigit() and run == os.environ.get("TORCHELASTIC_RUN_ID")  # a worker of our launcher's
    if os.getppid() != parent or parent == 1 or (ours and int(launcher) != parent):
        print("the launcher of this worker is gone: exiting", file=sys.stderr)
        os._exit(1)


def init_worker(device: str = "auto", cpu_offload: bool = False, timeout: float | None = None) -> Worker:
    """Join the process group started by our launcher or torchrun (or run alone without one).

    ``device`` is ``--device`` (auto, cpu, cuda); ``cpu_offload`` adds gloo to NCCL for offloaded tensors;
    ``timeout``: seconds a collective may wait for the other ranks (``--collective-timeout``).
    """
    wait = datetime.timedelta(seconds=timeout) if timeout else COLLECTIVE_TIMEOUT
    if "MASTER_ADDR" in os.environ:
        die_with_parent()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = local_world_size()
    kind = device_type(device)
    where = local_device(kind, local_rank, local_ranks)
    if kind == "cuda":
        torch.cuda.set_device(where)
    name = backend(kind, cpu_offload)
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        dist.init_process_group(
            backend=name, timeout=wait, device_id=where if name == "nccl" else None
        )
    elif not dist.is_initialized():
        # One process without a launcher: a group of one keeps every code path the same, and on a GPU
        # it is an NCCL group like any multi-rank run's (NCCL needs no peer for its id with one rank).
        dist.init_process_group(
            backend=name, store=dist.HashStore(), rank=0, world_size=1, timeout=wait
        )
    check_group_backend(kind, cpu_offload)
    if name != "nccl":
        _settle_gloo_threads_at_exit()
    return Worker(rank=rank, world_size=world_size, local_rank=local_rank, device=where,
                  local_world_size=local_ranks)


def check_group_backend(kind: str, cpu_offload: bool) -> None:
    """A process group made before ours (by the caller, for ``load_sharded``) must serve what the run
    sends: with --cpu-offload on CUDA, offloaded shards and gradients are CPU tensors, and a group with
    NCCL alone fails at the first of their collectives (clipping's norm), deep in a step."""
    if kind != "cuda" or not cpu_offload:
        return
    config = dist.get_backend_config()
    if "cpu:" not in config:
        raise ConfigError(
            f"CPU offload on CUDA needs a process group with a CPU backend, but this one has {config!r}: "
            "make it with dist.init_process_group(backend='cuda:nccl,cpu:gloo', ...), or let shardtune "
            "make it (call load_sharded or finetune before any init_process_group)")


@functools.cache
def _settle_gloo_threads_at_exit() -> None:
    atexit.register(let_gloo_threads_settle)  # once, however many times a process joins a group


def let_gloo_threads_settle(timeout: float = 2.0) -> None:
    """At interpreter exit, wait (GIL released) until gloo's worker threads are idle.

    A gloo thread drops its last reference to a finished collective's tensors only after the caller
    has seen it finish; when that tensor is a Python one, the drop takes the GIL. If the interpreter
    is already finalizing by then, the thread is made to exit inside C++ and the process aborts
    ("terminate called without an active exception", SIGABRT after a run that finished). The
    process group cannot be destroyed here instead: DTensors and their device meshes, in the user's
    model and in torch's caches, keep it alive until finalization. atexit runs before finalization,
    so a thread still waiting for the GIL gets it while this sleeps. Idle: every such thread
    sleeping, its CPU time unchanged over two polls. Our own workers leave by ``exit_worker``.
    """
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        time.sleep(0.01)
        now = {tid: (state, cpu) for tid, (name, state, cpu) in threads().items() if name.startswith("pt_gloo")}
        if now == last and all(state == "S" for state, _ in now.values()):
            return
        last = now


def threads() -> dict[int, tuple[str, str, float]]:
    """{thread id: (name, state, user + system CPU seconds)} of this process's threads (Linux; else {})."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has just exited
            continue
        name, _, rest = stat.partition("(")[2].rpartition(")")
        fields = rest.split()
        out[int(tid)] = (name, fields[0], (int(fields[11]) + int(fields[12])) / tick)  # state, utime + stime
    return out


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


def all_reduce_max(value: int, device: torch.device, group: dist.ProcessGroup | None = None) -> int:
    """The largest ``value`` of ``group``'s ranks (default all): one all-reduce, read on the host."""
    return all_reduce_max_each([value], device, group)[0]


def all_reduce_max_each(values: list[int], device: torch.device, group: dist.ProcessGroup | None = None
                        ) -> list[int]:
    """The largest of each of ``values`` over ``group``'s ranks (default all): one all-reduce, read on the host."""
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def all_gather_object(obj: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def worker_main(main: Callable[[], None]) -> None:
    """Run a worker's ``main`` under the elastic error recorder, then ``exit_worker`` with its status."""
    import traceback

    from torch.distributed.elastic.multiprocessing.errors import record

    die_with_parent()
    try:
        record(main)()
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message")
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except ShardtuneError as err:  # written for the user: the launcher shows the message, a traceback would bury it
        _end_progress_line()
        print(f"error: {err}", file=sys.stderr)
        code = err.exit_code
    except BaseException as err:  # record() has written the error file (with the traceback) for the launcher
        from shardtune.runtime.worker_failures import lost_peer

        lost = lost_peer(str(err))
        _end_progress_line()
        if lost:  # a consequence: the launcher names the rank that failed first, and why
            print(f"error: rank {os.environ.get('RANK', '?')} lost another rank ({lost}): that rank's failure "
                  "is the cause", file=sys.stderr)
        else:
            print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        if not os.environ.get(LAUNCHER_PID):  # plain torchrun: the traceback goes to its log
            traceback.print_exc()
        code = 1
    exit_worker(code)


def _end_progress_line() -> None:
    """A progress bar still drawn (a step's, when the step failed) ends its line: the worker's closing error then
    starts a line of its own, where the launcher's relay knows it (output_relay.WORKER_ERROR) and leaves it to
    the launcher's own message, not said twice."""
    std = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(std, "tqdm", None), "_instances", None) or ()):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - a bar that cannot close must not hide the error
            pass


def exit_worker(code: int) -> None:
    """Leave a worker process with ``code``, skipping interpreter teardown.

    Teardown after the process group is gone has been seen to abort a worker ("terminate called
    without an active exception", SIGABRT from a library thread, at random in CI), which turns a
    finished run into a failure and a clean stop into a crash. Everything is written by then.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
