"""The safety net: an exception no check foresaw ends as one short paragraph and exit code 3.

What failed, in which stage of the run, the exception's own message, and where its full traceback
was written; a user never has to read a stack trace to know what happened. ``stage`` marks the
stages (an exception leaving one carries its name as a note, which survives into the traceback a
worker's error file holds), and lets a test inject a failure at any of them
(``SHARDTUNE_TEST_FAIL_AT=STAGE``; ``stop@STAGE`` makes the last rank stop itself there (SIGSTOP),
``hang@STAGE`` stop responding;
``full@NAME:STEP`` makes the writes of NAME, a run's file or tracker, find the disk full from that
step on: see ``injected_full_disk``).
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardtune.errors import ShardtuneError

FAIL_AT = "SHARDTUNE_TEST_FAIL_AT"
STAGE_NOTE = "shardtune stage: "
TRACEBACK_FILE = "error-traceback.txt"


class UnexpectedError(ShardtuneError, RuntimeError):
    """An exception no check foresaw (a bug, or a fault of the machine); CLI exit code 3."""

    exit_code = 3


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Mark a stage of the run: a test may inject a failure here, and an unexpected exception leaving
    it is noted with the stage's name (our own errors need none: their messages say what to do)."""
    injected = os.environ.get(FAIL_AT, "")
    last = int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1
    if injected == f"stop@{name}" and last:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped mid-stage: a test sends it a signal, or a second writer
    if injected == f"hang@{name}" and last:
        # a hung rank: the others must not wait for ever. It answers nothing but dies of the launcher's SIGTERM
        # at once (a stopped one would cost every such test the elastic agent's 30 s wait before SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            signal.pause()
    try:
        if injected == name:
            raise RuntimeError(f"injected failure at stage '{name}' ({FAIL_AT})")
        yield
    except (ShardtuneError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        if stage_of(err) is None:
            err.add_note(f"{STAGE_NOTE}{name}")
        raise


def injected_full_disk(name: str, step: int, path: Path | str) -> None:
    """Raise the OSError of a full disk at a write of ``name`` (``metrics.jsonl``, ``tensorboard``, ...)
    at optimizer step ``step`` when a test asked for it (``SHARDTUNE_TEST_FAIL_AT=full@NAME:STEP``,
    several joined by commas): how the tests fill a disk at one chosen write, in a worker process,
    without a file system to fill."""
    for injected in os.environ.get(FAIL_AT, "").split(","):
        target, _, first = injected.removeprefix("full@").partition(":")
        if injected.startswith("full@") and target == name and first.isdigit() and step >= int(first):
            raise OSError(errno.ENOSPC, f"No space left on device (injected by {FAIL_AT})", str(path))


def stage_of(err: BaseException | str) -> str | None:
    """The stage an exception (or a traceback's text) was noted with."""
    notes = getattr(err, "__notes__", []) if isinstance(err, BaseException) else str(err).splitlines()
    return next((n.strip()[len(STAGE_NOTE):] for n in notes if n.strip().startswith(STAGE_NOTE)), None)


def write_traceback(text: str, out: Path | None) -> Path:
    """Write ``text`` to ``OUT/error-traceback.txt``, or to a temporary file when there is no --out
    to write in yet (nothing appears in --out before a run is accepted)."""
    if out is not None and Path(out).is_dir():
        path = Path(out) / TRACEBACK_FILE
        try:
            path.write_text(text)
            return path
        except OSError:
            pass
    fd, name = tempfile.mkstemp(prefix=f"shardtune-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(name)


def unexpected(what: str, stage_name: str | None, message: str, traceback_text: str,
               out: Path | None) -> UnexpectedError:
    """The one paragraph for an unexpected failure; its full traceback is written first."""
    path = write_traceback(traceback_text, out)
    where = f" in stage '{stage_name}'" if stage_name else ""
    return UnexpectedError(
        f"{what} failed unexpectedly{where}: {message.strip().splitlines()[0] if message.strip() else '?'}\n"
        f"This is no input problem shardtune checks for (most likely a bug, or a fault of this machine). "
        f"The full traceback is in {path}: please include it when you report this.")
