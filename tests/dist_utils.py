"""Run a function on N real processes (gloo, CPU) and collect what each rank returns.

The rank processes are forked from a server process that has imported torch, transformers, peft and
shardtune's recipe once per test session (``multiprocessing``'s forkserver): a spawned rank spent ~6 s of
CPU importing them, more than most tests' training. Each rank is still a process of its own, made for the
call: nothing of the test process is forked, and it runs in the test's environment and working directory
at the time of the call (as a spawned one would).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from shardtune.runtime.distributed import exit_worker
from shardtune.runtime.workers import free_port

#: What the server imports before it forks a rank: what nearly every rank function imports.
PRELOAD = ["shardtune", "torch", "transformers", "peft", "shardtune.train.job", "shardtune.train.recipe"]


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple, env: dict[str, str],
           cwd: str) -> None:
    os.environ.clear()  # the test's environment now, not the server's at its start
    os.environ.update(env)
    os.chdir(cwd)
    # The server's stdout and stderr were those of the test that started it: this rank's output goes to a
    # file that run_ranks relays to the calling test's output (pytest shows it with a failure).
    log = os.open(Path(out_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2-core machines: one thread per rank avoids oversubscription
    result = fn(rank, world_size, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # As shardtune's own workers do: interpreter teardown has aborted finished ranks (SIGABRT) at random.
    exit_worker(0)


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 900) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` new processes; returns their results.

    ``fn`` must be importable (module level); it sets up the process group itself (e.g. with
    ``shardtune.distributed.init_worker()``), which reads the env this helper sets. ``timeout`` only
    ends a hung run; it is no speed requirement (the machine may be busy).
    """
    out_dir = tempfile.mkdtemp(prefix="ranks-")
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: at the session's first call
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args, dict(os.environ), os.getcwd()),
                             nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout} s")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    finally:
        for r in range(world_size):
            log = Path(out_dir) / f"rank{r}.log"
            text = log.read_text(errors="replace") if log.is_file() else ""
            if text:
                sys.stderr.write(f"--- {fn.__name__}, rank {r} of {world_size}:\n{text}")
        shutil.rmtree(out_dir, ignore_errors=True)


def trained_job(options: dict):
    """Inside a rank of ``run_ranks``: the job of ``options`` prepared and trained for its steps, with
    the memory monitor and ``train``'s result: ``(job, memory, result)``; the caller closes ``memory``."""
    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.job import setup
    from shardtune.train.recipe import train

    cfg = build_config(options)
    worker = distributed.init_worker()
    memory = MemoryMonitor(worker.device)
    job = setup(cfg, worker, memory)
    out = Path(cfg.output.out)
    out.mkdir(parents=True, exist_ok=True)
    return job, memory, train(job, memory, out)


def finetune_rank(rank: int, world_size: int, options: dict) -> dict:
    """One rank of ``shardtune.finetune(options)`` in a world of ``run_ranks``, which sets RANK and WORLD_SIZE
    as plain torchrun does: on every rank the command checks its input, plans and trains in place."""
    import shardtune

    return shardtune.finetune(options)


def finetune_on_ranks(options: dict, nproc: int = 1) -> dict:
    """``shardtune.finetune(options)`` as ``torchrun --nproc-per-node NPROC -m shardtune finetune`` runs it
    (ranks forked from the preloaded server: no launcher, no worker imports), for tests of what a run
    computes rather than of how its processes start; returns the run's summary.json."""
    out = Path(options["out"])
    run_ranks(finetune_rank, nproc, {k: v for k, v in options.items() if k != "nproc"})
    return json.loads((out / "summary.json").read_text())


def rank_processes(launcher: int, module: str) -> dict[int, object]:
    """The rank processes (psutil) under ``launcher`` that run ``module``, by rank: forked from a warm starter
    (named ``shardtune rN``, runtime/warm_start.py) or, started fresh, ``python -m module`` itself."""
    import psutil

    found = {}
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            name = child.name()
            if name.startswith("shardtune r"):
                found[int(name.removeprefix("shardtune r"))] = child
            elif module in child.cmdline() and child.cmdline()[:2] != [sys.executable, "-c"]:
                found[int(child.environ()["RANK"])] = child
        except (psutil.Error, KeyError, ValueError):
            continue
    return found
