"""The workers' output, relayed to this process as it is written.

Workers write to files, not to our terminal, because in a notebook the kernel's file descriptors
are not the cell's output: only ``sys.stdout`` reaches the user there.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


class OutputRelay(threading.Thread):
    """Copies the workers' output files to this process's sys.stdout/sys.stderr as they grow.

    Workers write to files, not to our terminal, because in a notebook the kernel's file
    descriptors are not the cell's output: only ``sys.stdout`` reaches the user there.
    """

    def __init__(self, log_dir: Path) -> None:
        super().__init__(daemon=True, name="shardtune-relay")
        self.log_dir, self.done = log_dir, threading.Event()
        self.offsets: dict[Path, int] = {}

    def pump(self) -> None:
        for path in sorted(self.log_dir.glob("**/std*.log")):
            size = path.stat().st_size
            start = self.offsets.get(path, 0)
            if size > start:
                with path.open("rb") as f:
                    f.seek(start)
                    chunk = f.read(size - start)
                self.offsets[path] = size
                stream = sys.stderr if path.name == "stderr.log" else sys.stdout
                stream.write(chunk.decode("utf-8", "replace"))
                stream.flush()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.pump()

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.pump()
