"""Per-rank peak memory by phase: private CPU memory (RssAnon, sampled) and, on GPU, CUDA's own peaks.

RssAnon, not RSS: safetensors files are memory-mapped, and mapped file pages are shared, reclaimable
page cache rather than memory the process owns.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

MB = 1024 * 1024


def rss_anon_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemoryMonitor:
    """Samples RssAnon in a background thread; ``phase(name)`` records the peak within a block."""

    def __init__(self, device: torch.device, interval: float = 0.01) -> None:
        self.device = device
        self.interval = interval
        self.peaks: dict[str, dict[str, float]] = {}
        self._peak = rss_anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="shardtune-memory")
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, rss_anon_bytes())

    def close(self) -> None:
        self._stop.set()

    def now_mb(self) -> float:
        """What the progress bar shows: GPU memory allocated, or private CPU memory."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / MB
        return rss_anon_bytes() / MB

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._peak = rss_anon_bytes()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            peak = {"rss_anon_mb": max(self._peak, rss_anon_bytes()) / MB}
            if self.device.type == "cuda":
                peak["cuda_allocated_mb"] = torch.cuda.max_memory_allocated(self.device) / MB
                peak["cuda_reserved_mb"] = torch.cuda.max_memory_reserved(self.device) / MB
            self.peaks[name] = peak

    def peak_mb(self, name: str) -> float | None:
        """The headline peak of a phase: CUDA allocated on GPU, RssAnon on CPU."""
        peak = self.peaks.get(name)
        if peak is None:
            return None
        return round(peak.get("cuda_allocated_mb", peak["rss_anon_mb"]), 1)
