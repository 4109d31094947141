"""Who a process id is: alive or not, since when, running what. What tells a lock's (or a temporary
file's) owner from another process that got the same pid after a reboot or a container restart.

Linux's ``/proc`` answers; elsewhere each question answers None ("cannot tell") and callers fall
back on whether the pid is alive at all.
"""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (any owner)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but alive
    except OSError:
        return False
    return True


def boot_id() -> str | None:
    """This boot's id: another one means the machine restarted since (every pid is new)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22): the same pid with
    another start is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    try:
        return int(fields[19])  # fields[0] is field 3 (state)
    except (IndexError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When ``pid`` started, as a wall-clock time (seconds since the epoch), or None."""
    ticks = start_ticks(pid)
    try:
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK") if ticks is not None else None
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def command_of(pid: int) -> str | None:
    """The command line of ``pid`` ("python -m shardtune merge …"), or None when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip() or None


def identity() -> dict:
    """This process, as a lock records it: pid, boot and start, so that a later reader can tell
    whether the pid still names this process."""
    return {"pid": os.getpid(), "boot": boot_id(), "pid_start": start_ticks(os.getpid())}


def gone(holder: dict, written_at: float | None = None) -> str | None:
    """Why the process a lock names (``holder``: pid, boot, pid_start, from ``identity``) is no longer
    the one that wrote it, or None when it may still be. ``written_at``: when the lock was written
    (a process that started later cannot have written it). Same machine only."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return None
    now_boot = boot_id()
    if holder.get("boot") and now_boot and holder["boot"] != now_boot:
        return "the machine has restarted since"
    if not alive(pid):
        return "it is no longer running"
    ticks = start_ticks(pid)
    if holder.get("pid_start") is not None and ticks is not None and ticks != holder["pid_start"]:
        return f"pid {pid} now belongs to another process ({_short(command_of(pid))})"
    started = started_at(pid)
    if holder.get("pid_start") is None and started is not None and written_at and started > written_at + 2:
        return f"pid {pid} now belongs to a process started after the lock was written ({_short(command_of(pid))})"
    command = command_of(pid)
    if holder.get("pid_start") is None and command and not any(w in command for w in ("python", "shardtune")):
        return f"pid {pid} now belongs to another program ({_short(command)})"
    return None


def _short(command: str | None) -> str:
    if not command:
        return "unknown"
    return command if len(command) <= 60 else command[:57] + "…"
