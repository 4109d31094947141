"""FSDP2's collectives for gloo: the all-gather and reduce-scatter ``parallel/fsdp2.py`` gives FSDP2 on CPU.

They implement FSDP2's ``AllGather`` and ``ReduceScatter`` interfaces (private to torch): set on a
unit, and their signatures checked, in runtime/compat/fsdp.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class BroadcastAllGather:
    """FSDP2's all-gather as one in-place broadcast per rank, for gloo (FSDP2's ``AllGather``
    interface: ``allocate`` and ``__call__``; the class itself is private to torch).

    Gloo's all-gather receives into a new flat tensor of the full size and copies that into the
    output; with FSDP2's input (a slice of the output) it holds twice the gathered size on top of the
    output, and the copies take longer than the gather. Broadcasting each rank's slice in place moves
    the same bytes and allocates nothing.

    All broadcasts are issued at once and returned as one handle. Gloo runs them on its own threads,
    so a gather FSDP2 prefetches (the next layer's, in forward and backward) moves while this rank
    computes. A handle also marks the gather as asynchronous, and FSDP2 then frees the gather buffer
    right after copying it out, instead of keeping it until the next unit's gather to overlap the two
    on CUDA streams (on CPU that only holds one more buffer).
    """

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        chunks = output_tensor.chunk(world)
        if input_tensor.data_ptr() != chunks[rank].data_ptr():
            chunks[rank].copy_(input_tensor)
        return _AllOf([dist.broadcast(chunks[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
                       for r in range(world)])


class _AllOf(dist.Work):
    """One handle for several collectives: gloo may finish them on different threads in any order."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: object = None) -> bool:
        for work in self.works:
            work.wait()
        return True


class DeferredReduceScatter:
    """FSDP2's reduce-scatter of gradients, started and not waited for, for gloo (FSDP2's
    ``ReduceScatter`` interface); ``wait`` finishes every one started, before anyone reads a gradient.

    On CUDA FSDP2 reduces on a stream of its own and the next layer's backward goes on at once; on
    the CPU each layer's reduce blocks until every rank has reached it, so the ranks meet once per
    layer in backward and each meeting costs what the slower rank is behind. Started
    asynchronously, the ranks meet only at the
    gathers, which FSDP2 prefetches a layer ahead.

    Safe because FSDP2 only wraps the output as the sharded gradient (trainable weights are fp32,
    the reduce dtype, so no cast reads it) unless it adds it to a gradient already there. So it
    defers only between ``arm`` (told that no gradient is there) and ``wait``, which the training
    step calls around its reducing backward; any other backward (a user's own loop) reduces at once.
    Not for HSDP, whose all-reduce reads the output right away.
    """

    def __init__(self) -> None:
        self.pending: list[dist.Work] = []
        self.deferred = False

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None:
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
        if async_op:
            return work
        if self.deferred:
            self.pending.append(work)
        else:
            work.wait()
        return None

    def arm(self, gradients_empty: bool) -> None:
        """Before a backward that reduces: defer only when no gradient is there to be added to."""
        self.deferred = gradients_empty

    def wait(self) -> None:
        """Finish every reduce started since ``arm``; later ones complete at once again."""
        self.deferred = False
        for work in self.pending:
            work.wait()
        self.pending.clear()
