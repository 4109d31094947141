"""How shardtune tunes a CPU process, in one place: glibc's allocator, compute threads per worker, and
whether FSDP2 gathers through shared memory.

- ``tune_malloc``: every process that allocates large tensors on the CPU (training workers,
  ``merge``, ``export``) calls it first;
- ``worker_env``: what CPU workers get in their environment (and nothing else does: the launching
  process, a notebook kernel say, keeps its own): glibc's huge-page tunable, and one compute thread
  pool per worker sized to its share of the cores;
- ``shared_gather_enabled``: FSDP2's gathers through memory the ranks of a host share
  (parallel/host_gather.py), which the memory model counts too.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's mallopt parameter, and the threshold we set (glibc's own starting value).
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 1024


def tune_malloc() -> str:
    """Make glibc give every freed block of 128 KiB or more back to the system at once.

    Why: glibc serves allocations below its mmap threshold from its heap, and raises that threshold
    (up to 32 MiB) each time a larger mmap-ed block is freed. FSDP2 allocates each parameter's
    unsharded copy on its own (megabytes each) and frees it a layer later, while longer-lived
    activations land in between; the freed holes then cannot serve the next layer's copies and the
    heap keeps growing, so freed memory counts in the peak as if it were in use (bench/memory.py
    shows it with ``SHARDTUNE_MALLOC=default``). A fixed threshold turns that off;
    FSDP1's one flat buffer per unit was already above it. ``MALLOC_MMAP_THRESHOLD_`` in the
    environment (glibc's own setting) wins; ``SHARDTUNE_MALLOC=default`` keeps glibc's defaults.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']} from the environment"
    if os.environ.get("SHARDTUNE_MALLOC") == "default":
        return "glibc defaults (SHARDTUNE_MALLOC=default)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "unchanged (no mallopt: not glibc)"
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return "unchanged (mallopt refused)"
    return f"mmap threshold {MMAP_THRESHOLD // 1024} KiB"


#: glibc's tunable that backs its memory with transparent huge pages (madvise), read when a process starts
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def worker_malloc_env(device_type: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What CPU workers add to their environment for glibc: its huge-page tunable.

    Why: under the mmap threshold every buffer FSDP2 gathers into is a fresh mapping, and the first
    write to each 4 KiB page faults and zeroes it, so filling a fresh buffer is several times slower
    than refilling a reused one (bench/page_faults.py). Huge pages take one fault per 2 MiB instead,
    at the same peak (bench/speed.py measures the step).
    Only on CPU, only where the tunable is not set already, and never with ``SHARDTUNE_MALLOC=default``.
    """
    env = os.environ if environ is None else environ
    if device_type != "cpu" or env.get("SHARDTUNE_MALLOC") == "default":
        return {}
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return {}
    return {"GLIBC_TUNABLES": f"{current}:{HUGE_PAGES}" if current else HUGE_PAGES}


def worker_threads(local_ranks: int) -> int:
    """Compute threads for each of ``local_ranks`` workers: their share of this machine's cores.

    Each worker would otherwise start one compute thread per core: N workers on C cores then
    oversubscribe them, which made a 2-rank CPU run 5x slower than 1 rank. (torchrun sets 1.)"""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def worker_env(device_type: str, local_ranks: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The CPU tuning a worker process gets in its environment (read when it starts): its compute
    threads (unless ``OMP_NUM_THREADS`` is set already) and glibc's tunables (``worker_malloc_env``)."""
    env = os.environ if environ is None else environ
    out = {} if "OMP_NUM_THREADS" in env else {"OMP_NUM_THREADS": str(worker_threads(local_ranks))}
    return {**out, **worker_malloc_env(device_type, env)}


_TOTAL_STORE_ORDER = ("x86_64", "amd64", "i386", "i686")


def shared_gather_supported() -> bool:
    """Whether this machine can share FSDP2's gather buffers: Linux ``memfd`` and a total-store-order CPU
    (a flag is a plain store, published after the part it guards: parallel/host_gather.py)."""
    return (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
            and platform.machine().lower() in _TOTAL_STORE_ORDER)


def shared_gather_enabled() -> bool:
    """Whether FSDP2 on CPU gathers through shared memory: where this machine can, unless
    ``SHARDTUNE_SHARED_GATHER=0`` (gloo broadcasts then, as on other hosts)."""
    return shared_gather_supported() and os.environ.get("SHARDTUNE_SHARED_GATHER", "1") != "0"
