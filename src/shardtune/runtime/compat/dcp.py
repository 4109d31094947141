"""DCP's load-target protocol (``__create_chunk_list__`` / ``__get_tensor_shard__``): ``ShardView``, a
tensor made of rectangles of a parameter, which ``dcp.load`` fills. It replaces the deprecated
``ShardedTensor``; a ``DTensor`` cannot describe FSDP1's slices (a flat range cuts rows partway)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch

from shardtune.runtime.compat.changed import PrivateAPIChanged

# --- DCP load targets ------------------------------------------------------------------------------


class ShardView(torch.Tensor):
    """A load target for ``dcp.load``: a tensor of ``shape`` of which this rank holds ``pieces``,
    rectangles given as (offsets, a tensor of their size that is written in place).

    Only a target: ``dcp.load`` asks it which rectangles to read (``__create_chunk_list__``) and where
    to put each (``__get_tensor_shard__``); ``detach`` returns it; any other operation is refused.
    """

    pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                pieces: list[tuple[tuple[int, ...], torch.Tensor]]) -> ShardView:
        view = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        view.pieces = pieces
        return view

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardView(shape={tuple(self.shape)}, pieces={[(o, tuple(t.shape)) for o, t in self.pieces]})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(f"ShardView is a load target for dcp.load only, not a tensor for {func}")

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, tensor in self.pieces:
            if torch.Size(offsets) == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: no local piece at {index.offset}")


@functools.cache
def check_load_target_protocol() -> None:
    """DCP must plan reads from a ``ShardView``'s own pieces and write into them (once per process)."""
    from torch.distributed.checkpoint import planner_helpers, utils
    from torch.distributed.checkpoint.metadata import MetadataIndex

    piece = torch.zeros(1, 2)
    view = ShardView((2, 2), piece.dtype, piece.device, [((1, 0), piece)])
    what = "torch.distributed.checkpoint's load-target protocol (__create_chunk_list__, __get_tensor_shard__)"
    try:
        chunks = planner_helpers._create_chunk_list(view)
        found = utils.find_tensor_shard(view, MetadataIndex("probe", torch.Size((1, 0))))
    except (AttributeError, TypeError, ValueError) as err:
        raise PrivateAPIChanged(what, f"probing it failed: {err}") from err
    if [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] != [((1, 0), (1, 2))] or found is not piece:
        raise PrivateAPIChanged(what, "a load target's own chunks are no longer used")


def piece_boxes(target: torch.Tensor) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
    """(index into the full tensor, where it goes) for each piece of a ``ShardView``, or the whole tensor."""
    if isinstance(target, ShardView):
        for offsets, tensor in target.pieces:
            yield tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape)), tensor
    else:
        yield (), target
