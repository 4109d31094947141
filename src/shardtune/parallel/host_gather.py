"""FSDP2's all-gather through memory that the ranks of one host share (CPU, gloo).

Why: gloo moves every gather through loopback TCP, on threads of its own that take the cores the
ranks compute on. Here the buffer FSDP2 gathers into is one buffer that every rank maps: FSDP2
copies each rank's shard into its part of it (as it always does), and the gather itself only tells
the others that the part is written. Nothing moves; the copy out of the buffer reads the other
ranks' parts where they wrote them. The gain is largest where a step is many small gathers (small
micro-batches, per-part units), where gloo's threads took the most CPU from the matrix products;
bench/speed.py and bench/step_profile.py measure it (bench/results/).

Each buffer size has a pool of shared buffers, each a ``memfd`` (no file to leave behind: the memory
goes when the last rank unmaps it) with a header of flags, one per rank: how many times the rank has
written its part (``written``) and how many times it is done reading the buffer (``released``). A rank
takes a buffer when it has released it and every other rank has too, writes, publishes, and waits for
the others' parts before FSDP2 reads them. A rank releases a buffer at its first call after the wait:
FSDP2 copies the buffer out right after the wait and never reads it again. All ranks make the same
gathers in the same order, so they pick the same buffer each time and create new ones (a collective)
at the same points; a pool grows to the gathers in flight at once (two: one in use, one prefetched).

Only where every rank of the group is on this host (same boot and host name, and the buffer checks
out) and memory for the buffer can be reserved; otherwise that size falls back to gloo broadcasts
(``gloo_comms.BroadcastAllGather``), decided by all ranks together. x86 and other total-store-order CPUs
only: a flag is a plain store, published after the part it guards.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from shardtune.parallel import gloo_comms
from shardtune.runtime import cpu_tuning

HEADER = 4096  # flags first; the data then starts page-aligned


class GatherTimeout(RuntimeError):
    """Another rank did not reach a shared-memory gather in time (it failed, or hangs)."""


def for_group(group: dist.ProcessGroup) -> SharedMemoryAllGather | gloo_comms.BroadcastAllGather:
    """FSDP2's all-gather on CPU: through shared memory where ``cpu_tuning.shared_gather_enabled``, else
    gloo broadcasts."""
    return SharedMemoryAllGather(group) if cpu_tuning.shared_gather_enabled() else gloo_comms.BroadcastAllGather()


@dataclass
class _Buffer:
    """One shared buffer: the flags of every rank and the data, mapped by every rank of the group."""

    flags: np.ndarray  # int64 [2, world]: row 0 written, row 1 released (times)
    data: torch.Tensor  # uint8, the buffer itself
    uses: int = 0  # times this rank has taken it
    mine: bool = False  # taken by this rank and not released yet
    taken: int = 0  # when this rank took it last (its count of gathers)


@dataclass
class _Pool:
    buffers: list[_Buffer] = field(default_factory=list)
    shared: bool = True  # False: this size is gathered by broadcasts (decided by all ranks)


class SharedMemoryAllGather:
    """FSDP2's ``AllGather`` (``allocate`` and ``__call__``) through buffers all ranks map.

    ``timeout_s``: how long to wait for another rank before raising ``GatherTimeout``.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float = 1800.0) -> None:
        self.group, self.rank, self.world = group, group.rank(), group.size()
        self.timeout_s = timeout_s
        self.pools: dict[int, _Pool] = {}
        self.by_address: dict[int, _Buffer] = {}  # data_ptr of a buffer allocate handed out
        self.waited: list[_Buffer] = []  # waited for since the last call: released at the next
        self.taken = 0  # gathers so far
        self.broadcast = gloo_comms.BroadcastAllGather()
        #: seconds this rank has waited for the others: to take a buffer back, for their parts
        self.waiting_s = {"release": 0.0, "write": 0.0}

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self._release_waited()
        numel = math.prod(size)
        nbytes = numel * dtype.itemsize
        pool = self.pools.get(nbytes)
        if pool is None:
            pool = self.pools[nbytes] = _Pool()
        self.taken += 1
        buffer = self._pick(pool) if pool.shared else None
        if buffer is None and pool.shared:
            buffer = self._new_buffer(nbytes)
            if buffer is None:
                pool.shared = False
            else:
                pool.buffers.append(buffer)
        if buffer is None:
            return torch.empty(*size, dtype=dtype, device=device)
        # Every other rank must be done reading this buffer's last use before this rank writes into it.
        last = buffer.uses
        self._until(lambda: bool((buffer.flags[1] >= last).all()), "release",
                    f"finish reading use {last} of a {buffer.data.numel()}-byte gather buffer")
        buffer.uses += 1
        buffer.mine, buffer.taken = True, self.taken
        tensor = buffer.data.view(dtype).view(*size)
        self.by_address[tensor.data_ptr()] = buffer
        return tensor

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self._release_waited()
        buffer = self.by_address.pop(output_tensor.data_ptr(), None)
        if buffer is None:  # not a shared buffer: gloo moves it
            return self.broadcast(output_tensor, input_tensor, group, async_op)
        chunk = output_tensor.chunk(self.world)[self.rank]
        if input_tensor.data_ptr() != chunk.data_ptr():
            chunk.copy_(input_tensor)
        buffer.flags[0, self.rank] = buffer.uses  # after the part it publishes (total store order)
        return _Written(self, buffer)

    def _pick(self, pool: _Pool) -> _Buffer | None:
        """The buffer this rank took longest ago and has released; None: make one more.

        Not the one the previous gather took, although this rank may have released it already:
        the others release it only after copying it out, so writing it again at once would wait
        for them every time (FSDP2 waits for one gather, then starts the next).
        """
        free = [b for b in pool.buffers if not b.mine and b.taken < self.taken - 1]
        return min(free, key=lambda b: b.taken, default=None)

    def _release_waited(self) -> None:
        for buffer in self.waited:
            buffer.flags[1, self.rank] = buffer.uses
            buffer.mine = False
        self.waited.clear()

    def _wait(self, buffer: _Buffer) -> None:
        self._release_waited()
        use = buffer.uses
        self._until(lambda: bool((buffer.flags[0] >= use).all()), "write",
                    f"write their parts of use {use} of a {buffer.data.numel()}-byte gather buffer")
        self.waited.append(buffer)

    def _until(self, done: Callable[[], bool], kind: str, what: str) -> None:
        """Poll ``done``: yield the core first (the other rank may need it), then sleep a little longer."""
        if done():
            return
        start, tries = time.monotonic(), 0
        while not done():
            tries += 1
            if tries < 32:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-5 * (tries - 31)))
                if time.monotonic() - start > self.timeout_s:
                    raise GatherTimeout(
                        f"FSDP2 all-gather (shared memory, rank {self.rank} of {self.world}): the other ranks "
                        f"did not {what} within {self.timeout_s:.0f} s; one of them failed or hangs")
        self.waiting_s[kind] += time.monotonic() - start

    def _new_buffer(self, nbytes: int) -> _Buffer | None:
        """A buffer all ranks map, made by group rank 0 (collective); None where any rank cannot."""
        if 8 + 16 * self.world > HEADER:  # more ranks than the header has flags for (the same on every rank)
            return None
        total = HEADER + nbytes
        offer: list[object] = [None]
        fd = -1
        if self.rank == 0:
            token = secrets.randbits(62)
            try:
                fd = os.memfd_create("shardtune-gather", os.MFD_CLOEXEC)
                os.ftruncate(fd, total)
                os.posix_fallocate(fd, 0, total)  # fails now (ENOSPC) rather than SIGBUS on a write later
                offer = [(_host(), os.getpid(), fd, token)]
            except OSError:
                if fd >= 0:
                    os.close(fd)
                fd = -1
        dist.broadcast_object_list(offer, src=dist.get_global_rank(self.group, 0), group=self.group)
        data = None
        if offer[0] is not None:
            host, pid, their_fd, token = offer[0]
            if host == _host():
                data = _map(f"/proc/{pid}/fd/{their_fd}" if self.rank else f"/proc/self/fd/{fd}", total)
            if data is not None and self.rank == 0:
                data[:8].view(torch.int64).fill_(token)
        ok = self._everyone(data is not None)  # every rank has mapped it, so rank 0 may close its fd
        if fd >= 0:
            os.close(fd)  # the mappings keep the memory
        # The same memory on every rank (not a namesake in another container): rank 0's token is there.
        if not ok or not self._everyone(int(data[:8].view(torch.int64).item()) == token):
            return None
        flags = data[8:8 + 16 * self.world].view(torch.int64).view(2, self.world).numpy()
        return _Buffer(flags=flags, data=data[HEADER:])

    def _everyone(self, yes: bool) -> bool:
        flag = torch.tensor([int(yes)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


class _Written(dist.Work):
    """The gather's handle: ``wait`` returns once every rank has written its part."""

    def __init__(self, gather: SharedMemoryAllGather, buffer: _Buffer) -> None:
        super().__init__()
        self.gather, self.buffer = gather, buffer

    def wait(self, timeout: object = None) -> bool:
        self.gather._wait(self.buffer)
        return True


def _host() -> tuple[str, str]:
    """This host, as the ranks compare it: its name and this boot's id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def _map(path: str, nbytes: int) -> torch.Tensor | None:
    try:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
