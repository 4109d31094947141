"""Why a run's workers failed: the errors the launcher raises, and the forensics that name the rank
that caused the others to fail (its message, its signal, or the rank the others waited for).

A worker's own user-facing error (a ShardtuneError) is shown as its message; an exception nothing
foresaw keeps its traceback (``WorkerCrash``); a rank killed by a signal is named with the signal
(``RankKilled``); ranks that failed only because they lost a peer are never named the cause.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


class WorkerError(ShardtuneError, RuntimeError):
    """A worker process failed; the message names the rank and its error."""


class WorkerCrash(WorkerError):
    """A worker raised an exception none of our checks foresaw; ``traceback`` holds its full text."""

    exit_code = 3

    def __init__(self, rank: int, message: str, traceback: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.message, self.traceback = rank, message, traceback


class RankTimeout(WorkerError):
    """The ranks that went on waited ``--collective-timeout`` for a rank that stopped responding."""


class RankKilled(WorkerError):
    """A rank was killed by a signal (SIGKILL: the kernel's out-of-memory killer, a scheduler, ``kill -9``)
    and wrote no error of its own; the other ranks only lost it."""


class Stopped(WorkerError):
    """SIGTERM or SIGINT stopped the run (sent to this launcher or to the workers); ``exit_code`` is 128 + signal."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"stopped by signal {signum}")
        self.signum, self.exit_code = int(signum), 128 + int(signum)


# How a rank's error reads when it only lost a peer: a consequence, not the cause.
_PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited", "communicator was aborted")
_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[.../pair.cc:537] " prefix


def lost_peer(message: str) -> str | None:
    """The collective library's own words when ``message`` says only that another rank went away
    ("Read error [127.0.0.1]:43397: Connection reset by peer"), without its source location and advice;
    None for any other message."""
    first = _SOURCE.sub("", message.strip().splitlines()[0] if message.strip() else "")
    for phrase in _PEER_LOST:
        at = first.find(phrase)
        if at >= 0:
            return first[:at + len(phrase)]
    return None


def _stderr_tail(failure: ProcessFailure, log_dir: Path) -> list[str]:
    """The last non-empty lines a worker wrote to stderr."""
    tail: list[str] = []
    for path in log_dir.glob(f"**/attempt_*/{failure.local_rank}/stderr.log"):
        tail = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()][-12:]
    return tail


def _cause_first(failure: ProcessFailure, tail: list[str]) -> tuple[bool, bool, int]:
    """Sort key putting the failure that caused the others first.

    Timestamps alone mislead: they have whole seconds, and a rank that lost a peer (the peer killed by
    SIGKILL, say) fails in the same second; the agent's own SIGTERM to the survivors also counts as failing.
    A worker without an error file (not ours, or killed) shows the lost peer in its stderr only.
    """
    text = str(failure.message) + "\n".join(tail[-3:])
    return (failure.exitcode == -signal.SIGTERM, any(p in text for p in _PEER_LOST), failure.timestamp or 0)


def _ours(last_line: str) -> bool:
    """Whether a traceback's last line ("package.module.Class: message") is one of our user-facing errors."""
    import importlib

    qualified = last_line.split(":", 1)[0]
    module, _, name = qualified.rpartition(".")
    if not module.startswith("shardtune"):
        return False
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except Exception:  # whatever that module is, it is not one we can check
        return False
    return isinstance(cls, type) and issubclass(cls, ShardtuneError)


TIMED_OUT = re.compile(r"timed out|timeout|watchdog caught collective", re.IGNORECASE)


def _silent_ranks(err: Exception, tails: dict[int, list[str]], world_size: int) -> list[int] | None:
    """The ranks the others waited for in vain, when every rank that failed did so by a collective's
    timeout (a rank stopped by SIGSTOP or a hung device fails in nothing: it is the one not listed)."""
    texts = {rank: str(f.error_file_data) + "\n".join(tails[rank]) for rank, f in err.failures.items()}
    timed_out = {rank for rank, text in texts.items() if TIMED_OUT.search(text)}
    # The silent rank itself is either not listed or was killed by the agent's shutdown (a signal).
    others = {rank for rank in texts if rank not in timed_out}
    if not timed_out or any(err.failures[rank].exitcode >= 0 for rank in others):
        return None
    return sorted(set(range(world_size)) - timed_out)


def describe(err: Exception, log_dir: Path, world_size: int = 0) -> WorkerError:
    """The error naming the first rank that failed, its message (and where its traceback goes)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(err, ChildFailedError):
        return WorkerError(str(err))
    tails = {rank: _stderr_tail(f, log_dir) for rank, f in err.failures.items()}
    silent = _silent_ranks(err, tails, world_size)
    if silent is not None:
        who = f"rank {', '.join(map(str, silent))}" if silent else "a rank of another node"
        waited = ", ".join(map(str, sorted(set(range(world_size)) - set(silent))))
        return RankTimeout(f"{who} stopped responding: rank(s) {waited} waited "
                           "--collective-timeout for it in a collective and gave up (a stopped or hung process, or a "
                           "hung device)")
    rank, failure = min(err.failures.items(), key=lambda item: _cause_first(item[1], tails[item[0]]))
    data = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
    if isinstance(data, dict) and data.get("message"):
        stack = data.get("extraInfo", {}).get("py_callstack", "")
        lines = [line for line in stack.strip().splitlines() if line.strip()]
        # The exception's own line follows the last frame ("  File ..." and its code lines, indented further);
        # a message may span lines, indented or not.
        after = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1) + 1
        while after < len(lines) and lines[after].startswith("    "):
            after += 1
        if after < len(lines) and _ours(lines[after]):
            # One of our errors: its message is written for the user, a traceback would only bury it.
            return WorkerError(f"rank {rank}: {data['message'].split(': ', 1)[-1]}")
        return WorkerCrash(rank, data["message"], stack)
    # Without an error file (a worker that is not ours, or one killed by a signal) its stderr tells.
    tail = tails[rank]
    last = tail[-1].split("]: ", 1)[-1] if tail else ""
    if failure.exitcode < 0:  # killed: it wrote nothing more, the others only lost it
        name = failure.signal_name() if failure.signal_name() != "<N/A>" else f"signal {-failure.exitcode}"
        who = " (the kernel's out-of-memory killer, a scheduler or `kill -9`)" if name == "SIGKILL" else ""
        return RankKilled(f"rank {rank} failed (killed by {name}){who}: it could write no error of its own, and "
                          f"the other ranks stopped because they lost it{'; its last output: ' + last if last else ''}")
    return WorkerError(f"rank {rank} failed (exit code {failure.exitcode}){': ' + last if last else ''}"
                       + ("\n" + "\n".join(tail) if tail else ""))
