"""Per-rank peak memory by phase: CPU memory (RssAnon + RssShmem, sampled) and, on GPU, CUDA's own peaks.

Not RSS: safetensors files are memory-mapped, and mapped file pages are shared, reclaimable page cache
rather than memory the process owns. RssShmem is the shared memory it maps: FSDP2's gather buffers on
CPU (parallel/host_gather.py), which every rank of a host maps, are counted in full on each.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

MB = 1024 * 1024
_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_size(n_bytes: float) -> str:
    """A size as every message prints one: binary units, three significant digits ("7.45 GiB", "339 MiB")."""
    for unit, scale in _BINARY_UNITS:
        if abs(n_bytes) >= scale:
            value = n_bytes / scale
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{n_bytes:.0f} B"

def resident_bytes() -> int:
    """RssAnon + RssShmem of this process (0 where /proc is not there)."""
    total = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


class MemoryMonitor:
    """Samples resident memory (RssAnon + RssShmem) in a background thread; ``phase(name)`` records
    the peak within a block."""

    def __init__(self, device: torch.device, interval: float = 0.01) -> None:
        self.device = device
        self.interval = interval
        self.peaks: dict[str, dict[str, float]] = {}
        self.starts: dict[str, float] = {}  # MB in use when each phase began (as now_mb)
        self.outside_torch: dict[str, float] = {}  # GPU: MB held outside torch's allocator at each phase's end
        self._peak = resident_bytes()
        # A sample read before a phase starts must not land in that phase's peak.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="shardtune-memory")
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._peak = max(self._peak, resident_bytes())

    def close(self) -> None:
        self._stop.set()

    def now_mb(self) -> float:
        """What the progress bar shows: GPU memory allocated, or CPU memory (RssAnon + RssShmem)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / MB
        return resident_bytes() / MB

    def peak_so_far_mb(self) -> float:
        """The progress bar's figure: the peak since the current phase began (CUDA allocated on GPU)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MB
        with self._lock:
            return max(self._peak, resident_bytes()) / MB

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.starts[name] = self.now_mb()  # before "load": the runtime, what the planner holds fixed
        with self._lock:
            self._peak = resident_bytes()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            peak = {"resident_mb": max(self._peak, resident_bytes()) / MB}
            if self.device.type == "cuda":
                peak["cuda_allocated_mb"] = torch.cuda.max_memory_allocated(self.device) / MB
                peak["cuda_reserved_mb"] = torch.cuda.max_memory_reserved(self.device) / MB
                free, total = torch.cuda.mem_get_info(self.device)
                self.outside_torch[name] = (total - free - torch.cuda.memory_reserved(self.device)) / MB
            self.peaks[name] = peak

    def runtime_mb(self) -> float | None:
        """What the planner's "runtime" term predicts, measured. CPU: the process's memory before loading
        (RssAnon + RssShmem when "load" began). GPU: the device memory held outside torch's caching
        allocator (the CUDA context, NCCL's buffers, libraries' workspaces; and what other processes
        hold on this GPU), the most seen at the end of a phase (NCCL's buffers come with the first
        collectives). None before a phase has run."""
        if self.device.type == "cuda":
            return round(max(self.outside_torch.values()), 1) if self.outside_torch else None
        return round(self.starts["load"], 1) if "load" in self.starts else None

    def cuda_peaks_mb(self) -> dict[str, dict[str, float | None]]:
        """{phase: {"allocated": MB, "reserved": MB}}: torch's CUDA peaks of each phase (None off GPU)."""
        return {name: {kind: (round(p[f"cuda_{kind}_mb"], 1) if f"cuda_{kind}_mb" in p else None)
                       for kind in ("allocated", "reserved")} for name, p in self.peaks.items()}

    def peak_mb(self, name: str) -> float | None:
        """The headline peak of a phase: CUDA allocated on GPU, RssAnon + RssShmem on CPU."""
        peak = self.peaks.get(name)
        if peak is None:
            return None
        return round(peak.get("cuda_allocated_mb", peak["resident_mb"]), 1)
