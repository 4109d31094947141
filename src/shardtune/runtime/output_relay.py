"""The workers' output, relayed to this process as it is written.

Workers write to files, not to our terminal, because in a notebook the kernel's file descriptors
are not the cell's output: only ``sys.stdout`` reaches the user there.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from shardtune.runtime.logs import verbose

#: How a failing worker's last lines start (runtime/distributed.py's ``worker_main``). The launcher then says the
#: cause once, naming the rank (runtime/worker_failures.py), so these stay out of the relayed output: else a
#: user reads the same message once per rank and then again (``--verbose`` shows them).
WORKER_ERROR = "error: "


def until_worker_error(text: str) -> tuple[str, bool]:
    """``text`` up to a line that starts a worker's closing error, and whether it had one."""
    at = 0
    for line in text.splitlines(keepends=True):
        if line.startswith(WORKER_ERROR):
            return text[:at], True
        at += len(line)
    return text, False


class OutputRelay(threading.Thread):
    """Copies the workers' output files to this process's sys.stdout/sys.stderr as they grow.

    Workers write to files, not to our terminal, because in a notebook the kernel's file
    descriptors are not the cell's output: only ``sys.stdout`` reaches the user there.
    """

    def __init__(self, log_dir: Path) -> None:
        super().__init__(daemon=True, name="shardtune-relay")
        self.log_dir, self.done = log_dir, threading.Event()
        self.offsets: dict[Path, int] = {}
        self.ended: set[Path] = set()  # stderr files whose worker has written its closing error
        self.verbose = verbose()
        self.open_line: set[object] = set()  # the streams whose last text relayed ended mid-line

    def pump(self) -> None:
        for path in sorted(self.log_dir.glob("**/std*.log")):
            size = path.stat().st_size
            start = self.offsets.get(path, 0)
            if size > start:
                with path.open("rb") as f:
                    f.seek(start)
                    chunk = f.read(size - start)
                self.offsets[path] = size
                text = chunk.decode("utf-8", "replace")
                if path.name == "stderr.log" and not self.verbose:
                    if path in self.ended:
                        continue
                    text, ended = until_worker_error(text)
                    if ended:
                        self.ended.add(path)
                stream = sys.stderr if path.name == "stderr.log" else sys.stdout
                if text:
                    stream.write(text)
                    stream.flush()
                    (self.open_line.discard if text.endswith("\n") else self.open_line.add)(stream)

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.pump()

    def stop(self) -> None:
        """Relay the rest, and end a line a worker left open (a progress bar's frame, a line cut short
        by its error), so that what this process prints next starts a line of its own."""
        self.done.set()
        self.join()
        self.pump()
        for stream in self.open_line:
            stream.write("\n")
            stream.flush()
        self.open_line.clear()
