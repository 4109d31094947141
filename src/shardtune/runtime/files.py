"""Writing files so that nothing already on disk is lost: staged directories, output checks, clear OS errors.

A directory (or file) is written under a temporary name next to its final place, ``.NAME.tmp-PID``,
and renamed when complete, so a reader sees the old one or the new one, never half of either; a
failed or interrupted write (Ctrl-C, SIGTERM: see runtime/signals.py) removes its temporary. What a
write killed outright (SIGKILL, power loss) leaves is removed by the next write to the same place
(``clear_stale``).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardtune.errors import ShardtuneError
from shardtune.runtime.processes import alive

log = logging.getLogger("shardtune")


class OutputError(ShardtuneError, RuntimeError):
    """An output path cannot be written (exists, not empty, is an input, read-only, disk full); names the path."""


_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EEXIST: "it already exists",
}


def output_error(err: OSError, path: Path | str) -> OutputError:
    """``err`` as one sentence that names the file being written (``err.filename`` when it has one)."""
    where = err.filename or path
    reason = _REASONS.get(err.errno, err.strerror or str(err))
    return OutputError(f"cannot write {where}: {reason}")


def check_writable(path: str | Path) -> None:
    """Refuse a directory that cannot be made or written here (its nearest existing ancestor decides)."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OutputError(f"cannot create {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        reason = "the file system is read-only" if _read_only(probe) else "permission denied"
        raise OutputError(f"cannot write {path}: {reason} ({probe})")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def replace_dir(tmp: Path, final: Path) -> None:
    """Put a fully written ``tmp`` at ``final``; a reader sees the old or the new one, never half.

    The old ``final`` is removed only once ``tmp`` is in its place; if that move fails, the old one
    is put back, so nothing already written is lost.
    """
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def temporary_of(final: Path) -> Path:
    """The temporary name a write of ``final`` by this process uses."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def clear_stale(final: Path) -> list[Path]:
    """Remove what interrupted writes of ``final`` left beside it; return what was removed.

    Temporaries ``.NAME.tmp-PID`` whose process is gone are removed. A ``.NAME.old`` (``replace_dir``
    interrupted between its two renames) is the previous complete output: put back when ``final`` is
    missing, else removed. Callers hold ``final``'s writer lock (runtime/lock.py), so no live write of
    the same place can be mistaken for a stale one.
    """
    final = Path(final)
    removed = []
    if not final.parent.is_dir():
        return removed
    for tmp in final.parent.glob(f".{glob.escape(final.name)}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not alive(int(pid))):
            _remove(tmp)
            removed.append(tmp)
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        if final.exists():
            _remove(old)
            removed.append(old)
        else:
            os.replace(old, final)
            log.warning("restored %s from %s, left by a write that was interrupted", final, old.name)
    if removed:
        log.info("removed what an interrupted write left: %s", ", ".join(p.name for p in removed))
    return removed


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``final``; it becomes ``final`` when the block succeeds.

    On any failure, an interruption included, the temporary directory is removed and ``final`` is as
    it was; an OSError (a full disk, a read-only file system) becomes an OutputError naming the file.
    """
    final = Path(final)
    tmp = temporary_of(final)
    try:
        clear_stale(final)
        tmp.mkdir(parents=True)
        yield tmp
        replace_dir(tmp, final)
    except OSError as err:
        raise output_error(err, final) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def staged_file(final: Path) -> Iterator[Path]:
    """``staged_dir`` for a file: yield a temporary path next to ``final``, renamed to it when the block succeeds."""
    final = Path(final)
    tmp = temporary_of(final)
    try:
        clear_stale(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, final)
    except OSError as err:
        raise output_error(err, final) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: a failed write leaves the old file whole."""
    with staged_file(Path(path)) as tmp:
        tmp.write_text(text, encoding="utf-8")


def fingerprint(path: str | Path) -> dict | None:
    """Size and SHA-256 of a file, or of every file of a directory (a saved ``datasets`` directory),
    names included: what tells a resumed run that its data is still the data it started on. None for
    a name that is no local path (a Hub dataset: its cached revision is what datasets reads)."""
    path = Path(path)
    if not path.exists():
        return None
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    digest, size = hashlib.sha256(), 0
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        size += file.stat().st_size
    return {"path": str(path), "bytes": size, "sha256": digest.hexdigest()}
