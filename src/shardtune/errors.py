"""The one base class of every error a user can fix: the CLI catches it, prints its message and exits 2.

Each message names the file, line, key, option or module at fault. Raising one of these instead of
letting a library's exception escape is how bad input stays a clear one-paragraph error. Reading a
text file the user named (config, data, prompts, metrics) lives here too, so that every such file
fails the same way, naming itself, whatever floor reads it.
"""

from __future__ import annotations

from pathlib import Path


class ShardtuneError(Exception):
    """An input or situation the user must fix; ``str(err)`` says which and why. CLI exit code 2."""

    exit_code = 2


class InputError(ShardtuneError, ValueError):
    """A file the user pointed us at cannot be read; the message names it (and the line)."""


def read_text(path: str | Path, what: str, error: type[ShardtuneError] = InputError) -> str:
    """The UTF-8 text of ``path``; ``error`` (naming ``what``, the file and the line) when it has none."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} {path} is a directory, not a file")
    if not path.exists():
        raise error(f"{what} {path} does not exist")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise error(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {column}); "
                    f"save the {what} as UTF-8") from None
