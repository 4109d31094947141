"""The one base class of every error a user can fix: the CLI catches it, prints its message and exits 2.

Each message names the file, line, key, option or module at fault. Raising one of these instead of
letting a library's exception escape is how bad input stays a clear one-paragraph error. Reading a
text file the user named (config, data, prompts, metrics) lives here too, so that every such file
fails the same way, naming itself, whatever floor reads it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Literal


class ShardtuneError(Exception):
    """An input or situation the user must fix; ``str(err)`` says which and why. CLI exit code 2."""

    exit_code = 2


class InputError(ShardtuneError, ValueError):
    """A file the user pointed us at cannot be read; the message names it (and the line)."""


def _not_regular(mode: int) -> str | None:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return None


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def check_path(path: str | Path, what: str, kind: Literal["file", "dir", "any"] = "file", write: bool = False,
               error: type[ShardtuneError] = InputError) -> Path:
    """Refuse a path the user gave that cannot serve as ``kind`` (a regular file, a directory, or
    either), to read or (``write``) to create or replace; ``error`` says "``what`` PATH ...", and why.

    The one check for every path option, run before anything opens the path: a FIFO opened for
    reading blocks until a writer comes and a device file reads without end, so only its mode
    (``stat``, which never opens it) decides. A path to write may be missing, its folder may not.
    """
    path = Path(path).expanduser()
    name = f"{what} {path}".strip()
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # the latter: a part of the path is a file
        mode = None
    except OSError as err:  # a loop of links, no permission on a parent folder
        raise error(f"{name} cannot be used: {err.strerror or err}") from None
    if mode is None:
        if not write:
            parent = _nearest_existing(path.parent)
            missing = f" (nor does its folder {path.parent})" if parent != path.parent else ""
            raise error(f"{name} does not exist{missing}")
        folder = path.parent if kind == "file" else _nearest_existing(path.parent)
        if kind == "file" and not folder.exists() and _nearest_existing(folder).is_dir():
            raise error(f"{name} cannot be created: its folder {folder} does not exist")
        if not folder.is_dir():
            raise error(f"{name} cannot be created: {_nearest_existing(folder)} is a file, not a directory")
        _check_access(folder, os.W_OK | os.X_OK, name, path, "cannot be created", error)
        return path
    odd = _not_regular(mode)
    if odd and write and stat.S_ISCHR(mode) and kind == "file":
        odd = None  # /dev/null as a log file: writing to a character device neither blocks nor fills a disk
    if odd:
        raise error(f"{name} is {odd}, not a regular file" + (" or directory" if kind != "file" else ""))
    if stat.S_ISDIR(mode) and kind == "file":
        raise error(f"{name} is a directory, not a file")
    if not stat.S_ISDIR(mode) and kind == "dir":
        raise error(f"{name} is a file, not a directory")
    access = (os.W_OK if write else os.R_OK) | (os.X_OK if stat.S_ISDIR(mode) else 0)
    _check_access(path, access, name, path, "cannot be written" if write else "cannot be read", error)
    return path


def _check_access(probe: Path, access: int, name: str, path: Path, doing: str,
                  error: type[ShardtuneError]) -> None:
    if os.access(probe, access):
        return
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY) and access & os.W_OK
    except OSError:
        read_only = False
    reason = "the file system is read-only" if read_only else "permission denied"
    raise error(f"{name} {doing}: {reason}" + (f" ({probe})" if probe != path else ""))


#: compressed files read_text reads, as ``datasets`` does: (magic bytes, suffix, name)
_COMPRESSED = ((b"\x1f\x8b", ".gz", "gzip"), (b"BZh", ".bz2", "bzip2"), (b"\xfd7zXZ\x00", ".xz", "xz"))


def plain_suffix(path: str | Path) -> str:
    """The suffix of what ``read_text`` reads from ``path``: ``.jsonl`` for ``data.jsonl.gz``."""
    name = Path(path).name
    for _, suffix, _ in _COMPRESSED:
        name = name.removesuffix(suffix)
    return Path(name).suffix


def _decompressed(raw: bytes, path: Path, error: type[ShardtuneError]) -> bytes:
    """``raw``, decompressed when it is gzip, bzip2 or xz (told by its first bytes, whatever its name)."""
    import bz2
    import gzip
    import lzma

    for magic, _, name in _COMPRESSED:
        if raw.startswith(magic):
            try:
                return {"gzip": gzip.decompress, "bzip2": bz2.decompress, "xz": lzma.decompress}[name](raw)
            except (OSError, EOFError, ValueError, lzma.LZMAError) as err:
                raise error(f"{path}: a {name} file that cannot be decompressed ({err}): an interrupted copy or "
                            "download?") from None
    return raw


def read_text(path: str | Path, what: str, error: type[ShardtuneError] = InputError) -> str:
    """The UTF-8 text of ``path`` (decompressed first when it is gzip, bzip2 or xz); ``error`` (naming
    ``what``, the file and the line) when it has none."""
    path = check_path(path, what, "file", error=error)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
    raw = _decompressed(raw, path, error)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise error(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {column}); "
                    f"save the {what} as UTF-8") from None
