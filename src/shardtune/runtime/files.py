"""Writing files so that nothing already on disk is lost: staged directories, output checks, clear OS errors.

A directory is written under a temporary name next to its final place and renamed when complete, so
a reader sees the old one or the new one, never half of either; a failed write leaves nothing behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shardtune.errors import ShardtuneError


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


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_dir(out: str | Path, *, overwrite: bool, inputs: Iterable[str | Path | None] = (),
                     flag: str = "--overwrite") -> Path:
    """Refuse an output directory whose writing would lose something: one that is (or holds) an input,
    a file, a non-empty directory without ``overwrite``, or a place that cannot be written."""
    out = Path(out)
    real = out.resolve()
    for given in inputs:
        if given is not None and _inside(Path(given).resolve(), real):
            raise OutputError(f"output directory {out} would replace the input {given}: choose another output")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} is an existing file, not a directory: choose another output")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"output directory {out} already exists and is not empty: "
                          f"choose another, or pass {flag} to replace it")
    check_writable(out)
    return out


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


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``final``; it becomes ``final`` when the block succeeds.

    On any failure the temporary directory is removed and ``final`` is as it was; an OSError (a full
    disk, a read-only file system) becomes an OutputError naming the file.
    """
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        replace_dir(tmp, final)
    except OSError as err:
        raise output_error(err, final) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
