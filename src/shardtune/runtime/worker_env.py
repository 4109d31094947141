"""The environment of worker processes, set in their environment only; the caller's, kept as it was.

The launching process (a notebook kernel, a script calling ``shardtune.finetune``) keeps its own
``os.environ`` as it was. What the workers need is read when an interpreter starts (glibc's tunables,
Python's unbuffered output, OpenMP's thread count), so it is in the environment of the warm starter
the workers are forked from (warm_start.py), or, started fresh, added by each worker's first statement,
which then ``exec``s the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

from shardtune.config import ParallelConfig
from shardtune.runtime import cpu_tuning, warm_start
from shardtune.runtime.device import device_type
from shardtune.runtime.warm_start import LAUNCHER_PID


def worker_env(parallel: ParallelConfig, run_id: str) -> dict[str, str]:
    """What a worker of this launcher adds to the environment it inherits."""
    env = {
        # Workers die with this process (distributed.die_with_parent); tied to this run's id.
        LAUNCHER_PID: f"{os.getpid()}:{run_id}",
        **cpu_tuning.worker_env(device_type(parallel.device), parallel.nproc),
    }
    if "PYTHONUNBUFFERED" not in os.environ:  # worker output is a file: flush it line by line
        env["PYTHONUNBUFFERED"] = "1"
    return env


#: The first thing a worker runs: add the environment given as JSON, then become the worker itself
#: (``exec``: the same pid, so the launcher and ``die_with_parent`` see the process they started).
_BOOT = ("import json, os, sys; os.environ.update(json.loads(sys.argv[1])); "
         "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def starter_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of the starter workers with ``env`` added are forked from: this process's and
    ``env``, less the launcher's own id (a different one each run: the starter rewrites it per worker)."""
    return {**os.environ, **{k: v for k, v in env.items() if k != LAUNCHER_PID}}


def worker_command(env: dict[str, str], module: str, args: list[str]) -> tuple[str, list[str]]:
    """(entrypoint, arguments) that run ``python -m module *args`` with ``env`` added to its environment:
    forked from a warm starter started with this process's environment and ``env`` (less the launcher's
    own id, which differs each run), or, under ``SHARDTUNE_WORKER_START=fresh``, a fresh interpreter."""
    if warm_start.warm():
        return warm_start.client_command(warm_start.starter_address(starter_env(env)), env, module, args)
    return sys.executable, ["-c", _BOOT, json.dumps(env), "-m", module, *args]


@contextlib.contextmanager
def kept_environ() -> Iterator[None]:
    """Put ``os.environ`` back as it was when the block ends: what a run sets for its own process while
    it runs (torch's launcher: TORCHELASTIC_SIGNALS_TO_HANDLE; quiet logs: TOKENIZERS_PARALLELISM) does
    not stay in a notebook that runs several fine-tunes."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
