"""One writer per output: a lock file names the run (or command), host and process that hold it.

Two runs writing one ``--out`` mix their metrics, checkpoints and adapters; two merges or exports
writing one ``--out`` at once both say "wrote" and only the second result remains. Every command
that writes takes this lock first:

- a fine-tune writes *into* its ``--out``: the lock is ``OUT/.lock``;
- an output written whole and renamed into place (a merged model, a GGUF, an adapter) is locked
  beside it, ``.NAME.lock`` in its folder, since the folder itself is replaced.

Each also refuses while the other kind of lock on the same path is held by a live process.

The lock belongs to a run, not to a process: the launchers of one multi-node run share ``--out``
and its run id, so a second node joins the lock the first one took. A lock whose process is gone
(dead pid; a reboot since; a pid now used by another process, told apart by its start time) is
taken over with a warning; one from another host is only named, since its process cannot be
checked from here.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from shardtune.runtime.files import OutputError, check_writable, output_error
from shardtune.runtime.processes import gone, identity

log = logging.getLogger("shardtune")

LOCK_NAME = ".lock"


def inner_lock(out: Path) -> Path:
    """The lock of a folder that is written into (a fine-tune's ``--out``)."""
    return Path(out) / LOCK_NAME


def outer_lock(out: Path) -> Path:
    """The lock of an output written whole and renamed into place: beside it."""
    out = Path(out)
    return out.with_name(f".{out.name}.lock")


def _read(path: Path) -> dict | None:
    """The holder a lock file names; None when there is no lock file."""
    for _ in range(10):  # a lock created a moment ago may not have its contents yet
        try:
            holder = json.loads(path.read_text())
            if isinstance(holder, dict):
                return holder
        except (FileNotFoundError, NotADirectoryError):  # the latter: the output is a file, it has no inner lock
            return None
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {"host": "?", "pid": "?", "run": None}  # unreadable: treated as held, and named


def stale_reason(holder: dict) -> str | None:
    """Why the lock ``holder`` describes is left over (its process is gone), or None: held, or cannot tell."""
    if holder.get("host") != socket.gethostname():
        return None
    return gone(holder, holder.get("started"))


class RunLock:
    """``with RunLock(out, run_id):`` holds ``out``'s lock for the block, or raises OutputError naming its holder.

    ``whole=True``: ``out`` is written whole and renamed into place (locked beside it, ``outer_lock``);
    else it is a folder written into (``inner_lock``). ``what``: the holder's command, as named to a
    second writer ("shardtune merge").
    """

    def __init__(self, out: str | Path, run_id: str, whole: bool = False, what: str = "shardtune finetune") -> None:
        self.out, self.run_id, self.whole = Path(out), run_id, whole
        self.path = outer_lock(self.out) if whole else inner_lock(self.out)
        self.other = inner_lock(self.out) if whole else outer_lock(self.out)
        self.owner = {"run": run_id, "host": socket.gethostname(), **identity(), "command": what}
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        folder = self.path.parent
        check_writable(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise output_error(err, folder) from None
        self._refuse_if_held(self.other)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read(self.path)
                if holder is None:
                    continue  # removed meanwhile, or being written: look again
                if holder.get("run") == self.run_id:
                    return  # another node of this same run holds it
                reason = stale_reason(holder)
                if reason:
                    log.warning("taking over %s: left by process %s on %s (%s), which is gone: %s", self.path,
                                holder.get("pid"), holder.get("host"), holder.get("command") or "shardtune", reason)
                    self.path.unlink(missing_ok=True)
                    continue
                raise self._in_use(holder, self.path) from None
            except OSError as err:
                raise output_error(err, self.path) from None
            with os.fdopen(fd, "w") as f:
                json.dump({**self.owner, "started": time.time()}, f)
            self.held = True
            return
        raise OutputError(f"could not take the lock {self.path}: it keeps changing; is another run starting?")

    def _refuse_if_held(self, path: Path) -> None:
        """The other kind of lock on the same output: held by a live process, it refuses this writer too."""
        holder = _read(path)
        if holder is not None and holder.get("run") != self.run_id and stale_reason(holder) is None:
            raise self._in_use(holder, path)

    def _in_use(self, holder: dict, path: Path) -> OutputError:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        by = holder.get("command") or "shardtune finetune"
        kind = "output directory" if self.out.is_dir() or not self.whole else "output"
        return OutputError(
            f"{kind} {self.out} is in use by another run (process {holder.get('pid')} on {holder.get('host')}, "
            f"started {started}: {by}): wait for it to end or choose another --out. "
            f"If no such run is alive, delete {path}")

    def release(self) -> None:
        if self.held:
            self.held = False
            holder = _read(self.path)
            if holder is not None and holder.get("pid") == self.owner["pid"] and holder.get("run") == self.run_id:
                self.path.unlink(missing_ok=True)
