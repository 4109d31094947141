"""One run per output directory: ``OUT/.lock`` names the run, host and process that hold it.

Two runs writing one ``--out`` mix their metrics, checkpoints and adapters. The lock belongs to a
run, not to a process: the launchers of one multi-node run share ``--out`` and its run id, so a
second node joins the lock the first one took. A lock left by a process that is gone (same host,
dead pid) is taken over with a warning; one from another host is only named, since its process
cannot be checked from here.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from shardtune.runtime.files import OutputError, check_writable, output_error

log = logging.getLogger("shardtune")

LOCK_NAME = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but alive
    return True


class RunLock:
    """``with RunLock(out, run_id):`` holds ``out/.lock`` for the block, or raises OutputError naming its holder."""

    def __init__(self, out: str | Path, run_id: str) -> None:
        self.out, self.run_id = Path(out), run_id
        self.path = self.out / LOCK_NAME
        self.owner = {"run": run_id, "host": socket.gethostname(), "pid": os.getpid()}
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        check_writable(self.out)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise output_error(err, self.out) from None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # removed meanwhile, or being written: look again
                if holder.get("run") == self.run_id:
                    return  # another node of this same run holds it
                pid = holder.get("pid")
                if holder.get("host") == self.owner["host"] and isinstance(pid, int) and not _alive(pid):
                    log.warning("taking over %s: left by process %s on %s, which is no longer running",
                                self.path, holder.get("pid"), holder.get("host"))
                    self.path.unlink(missing_ok=True)
                    continue
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
                raise OutputError(
                    f"output directory {self.out} is in use by another run (process {holder.get('pid')} on "
                    f"{holder.get('host')}, started {started}): wait for it to end or choose another --out. "
                    f"If no such run is alive, delete {self.path}") from None
            except OSError as err:
                raise output_error(err, self.path) from None
            with os.fdopen(fd, "w") as f:
                json.dump({**self.owner, "started": time.time()}, f)
            self.held = True
            return
        raise OutputError(f"could not take the lock {self.path}: it keeps changing; is another run starting?")

    def _holder(self) -> dict | None:
        for _ in range(10):  # a lock created a moment ago may not have its contents yet
            try:
                holder = json.loads(self.path.read_text())
                if isinstance(holder, dict):
                    return holder
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        return {"host": "?", "pid": "?", "run": None}  # unreadable: treated as held, and named

    def release(self) -> None:
        if self.held:
            self.held = False
            holder = self._holder()
            if holder is not None and holder.get("pid") == self.owner["pid"] and holder.get("run") == self.run_id:
                self.path.unlink(missing_ok=True)
