"""The one base class of every error a user can fix: the CLI catches it, prints its message and exits 2.

Each message names the file, line, key, option or module at fault. Raising one of these instead of
letting a library's exception escape is how bad input stays a clear one-paragraph error.
"""

from __future__ import annotations


class ShardtuneError(Exception):
    """An input or situation the user must fix; ``str(err)`` says which and why. CLI exit code 2."""

    exit_code = 2
