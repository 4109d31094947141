"""``--activation-offload`` (GPUs): what a forward saves for backward waits in pinned host memory.

With activation checkpointing the tensors a forward keeps are each decoder layer's inputs (checkpoints
save them for their recomputation through autograd's saved-tensor hooks): layers × tokens × hidden, the
term that still grows with the context once the logits are gone (loss_head.py) and the layers' own
temporaries are tiled (tiling.py). Here each one leaves the GPU as it is saved, copied on a side stream
into pinned host memory while the next layer computes, and comes back, again on the side stream, one
layer ahead of the backward that needs it (torchtune's and TRL's approach; written anew here).

Correctness rules the code keeps: a GPU tensor is referenced until its copy out has finished (its
memory is not reused under the copy); the compute stream waits for a copy back before using it; a
tensor saved by several layers (rotary tables) is moved once, and only while that tensor lives (a new
tensor at a freed one's address, shape and dtype is another tensor); small tensors and parameters stay. On a
CPU there is nothing to move to: ``plan`` and ``finetune`` say so, and the hooks are not installed.
``Offloader(device, copy=...)`` lets the tests drive the bookkeeping on a CPU with plain copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

#: tensors smaller than this stay where they are (the copy would cost more than it frees)
MIN_BYTES = 1 << 20


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class Offloader:
    """The saved-tensor hooks of one forward and its backward."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES,
                 copy: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None) -> None:
        self.device, self.min_bytes = device, min_bytes
        self.cuda = device.type == "cuda" and copy is None
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._copy = copy  # CPU tests: a plain copy stands in for the transfer
        self.host: dict[int, torch.Tensor] = {}  # handle → host copy
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}  # handle → (GPU tensor, copy-out event)
        self.back: dict[int, tuple[torch.Tensor, object]] = {}  # handle → (GPU copy, copy-back event)
        self.keys: dict[tuple, tuple[int, StorageWeakRef]] = {}  # where a saved tensor lies → its handle
        self.uses: dict[int, int] = {}  # handle → saves not yet unpacked (a shared tensor is saved by several)
        self.moved = 0  # bytes moved out (tests, metrics)
        self._next = 0
        self._paused = 0

    # -- the hooks ---------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> object:
        if (self._paused or t.device != self.device or isinstance(t, nn.Parameter)
                or t.numel() * t.element_size() < self.min_bytes):
            return t
        key = _storage_key(t)
        known = self.keys.get(key)
        # Once moved out, a tensor's device memory is freed, and the allocator hands the same address to
        # the next tensor of its size (the next layer's input): a key alone would give backward the wrong one.
        if known is not None and not known[1].expired():
            self.uses[known[0]] += 1
            return known[0]
        handle = self._next
        self._next += 1
        self.keys[key] = (handle, StorageWeakRef(t.untyped_storage()))
        self.uses[handle] = 1
        self.host[handle] = self._out(t, handle)
        self.moved += t.numel() * t.element_size()
        self._release_finished()
        return handle

    def unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        handle = packed
        t = self._back(handle)
        self.uses[handle] -= 1
        if not self.uses[handle]:  # autograd holds it from here: ours go, so nothing outlives its use
            self.back.pop(handle, None)
            self.host.pop(handle, None)
        # Backward meets the handles in reverse: start bringing the one before back now.
        if handle - 1 in self.host and handle - 1 not in self.back:
            self._start_back(handle - 1)
        return t

    # -- the transfers -----------------------------------------------------------------------------

    def _out(self, t: torch.Tensor, handle: int) -> torch.Tensor:
        if not self.cuda:
            return self._copy(t, torch.device("cpu")) if self._copy else t.detach().clone()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[handle] = (t, event)  # t stays referenced until the copy has finished
        return host

    def _release_finished(self) -> None:
        for handle, (_, event) in list(self.pending.items()):
            if event.query():
                del self.pending[handle]

    def _start_back(self, handle: int) -> None:
        host = self.host[handle]
        if not self.cuda:
            self.back[handle] = (self._copy(host, self.device) if self._copy else host.clone(), None)
            return
        if handle in self.pending:  # still on its way out: the GPU copy is still there
            self.back[handle] = (self.pending.pop(handle)[0], None)
            return
        with torch.cuda.stream(self.stream):
            gpu = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.back[handle] = (gpu, event)

    def _back(self, handle: int) -> torch.Tensor:
        if handle not in self.back:
            self._start_back(handle)
        gpu, event = self.back[handle]
        if self.cuda and event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            gpu.record_stream(current)  # its memory may not be reused before the compute stream is done
        return gpu

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Saves inside stay where they are (the loss head's, needed first in backward)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def hooks(self) -> Iterator[Offloader]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


@contextlib.contextmanager
def offloaded(device: torch.device, enabled: bool) -> Iterator[Offloader | None]:
    """Around one forward (its backward may come after): the saved tensors offloaded when ``enabled`` on a
    GPU; nothing on a CPU, where they are in host memory already."""
    if not enabled or device.type != "cuda":
        yield None
        return
    with Offloader(device).hooks() as offloader:
        yield offloader
