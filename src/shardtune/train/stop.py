"""Stopping a run on SIGTERM/SIGINT: every rank finishes its step, checkpoints, and says how to resume.

A GRPO step that is still generating its batch stops sooner: the generation checks ``requested`` between tokens
and ends when any rank was asked to stop (``GenerationStopped``), so a scheduler's grace period is not spent
sampling completions that would be thrown away; the step is then not done, and the checkpoint is the last step's.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch

from shardtune.runtime import distributed
from shardtune.train.checkpoint_files import find_latest, resume_command


def stop_message(signum: int, out: Path, nnodes: int = 1, node_rank: int = 0) -> str:
    latest = find_latest(out)
    where = f"the newest complete checkpoint is {latest}" if latest else "no complete checkpoint was written"
    command = resume_command(out, nnodes, node_rank)
    return f"stopped by {signal.Signals(signum).name}; {where}. To continue, run: {command}"


class GenerationStopped(Exception):
    """Raised on every rank when a generation ended early because a rank was asked to stop (agreed on by all)."""


class GracefulStop:
    """While active, SIGTERM and SIGINT only set a flag: training stops after the step in progress.

    ``agreed()`` is a collective, so every rank stops after the same step even when only one
    received the signal, and none waits forever for a rank that left.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, device: torch.device) -> None:
        self.device, self.signum = device, 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        # Only a flag: logging or collectives from a signal handler can deadlock.
        self.signum = self.signum or signum

    def requested(self) -> bool:
        """Whether this rank received a signal (no collective)."""
        return bool(self.signum)

    def agreed(self) -> int:
        """The signal any rank received (0 when none did)."""
        return distributed.all_reduce_max(self.signum, self.device)
