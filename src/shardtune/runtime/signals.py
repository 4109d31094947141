"""SIGTERM handled like Ctrl-C in every command, and the one exception both end in.

Python ends a process on SIGTERM at once, without running a single ``finally``: an export or merge
stopped that way left its temporary file (hundreds of MB) and its lock behind. Under
``sigterm_as_interrupt`` SIGTERM raises ``Interrupted`` in the main thread instead, as Ctrl-C raises
KeyboardInterrupt, so temporaries are removed and locks released on the way out (runtime/files.py,
runtime/lock.py). ``Interrupted`` is a KeyboardInterrupt: a caller's ``except KeyboardInterrupt``
sees a stopped ``shardtune.finetune()``, and an ``except Exception`` loop does not swallow it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a command; ``str(err)`` says what was kept and how to go on. CLI exit
    code 128 + signal (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum, self.exit_code = int(signum), 128 + int(signum)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def signal_of(err: BaseException) -> int:
    """The signal behind an interruption (a bare KeyboardInterrupt is Ctrl-C's SIGINT)."""
    return err.signum if isinstance(err, Interrupted) else int(signal.SIGINT)


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Interrupted`` in the main thread, as Ctrl-C raises KeyboardInterrupt.

    (Only the main thread may set a handler; elsewhere the block runs with the handler it has.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
