"""Context parallelism, the sequence side: a micro-batch's rows cut into one piece per rank of a CP group.

The N ranks of a context-parallel (CP) group share one micro-batch. Each pads its rows to a width
divisible by N and keeps the contiguous piece ``[rank * piece, (rank + 1) * piece)`` of every row:
its input ids, position ids (which restart at every packed record, so rotary and learned positions
come out as without CP) and targets (pre-shifted, so a token's target travels with it even when the
next token lies in the next piece). Everything outside attention then works on the piece alone; the
attention across pieces is ``parallel/ulysses.py``, which needs to know where, in the whole row,
each record starts and ends: ``SequencePieces.bounds``.

Padding never counts: padded targets are ignored (the caller's ignore value) and padded tokens form
a segment of their own, which no record attends to. Contiguous pieces need no balancing for the
causal mask: Ulysses attention runs on the whole sequence for a share of the heads, so every rank
does the same attention work whatever its piece.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequencePieces:
    """How one micro-batch's rows are cut over a CP group, as every rank of the group sees it."""

    size: int  # ranks in the CP group (N)
    rank: int  # this rank's place in the group
    width: int  # the rows' width before padding
    length: int  # the rows' width after padding: a multiple of the granularity
    #: per row, the cuts between its segments over the padded row: 0, ..., ``length``; a segment is one
    #: packed record (or the whole row, unpacked) or a run of padding
    bounds: tuple[tuple[int, ...], ...]

    @property
    def piece(self) -> int:
        """Tokens of each row on one rank."""
        return self.length // self.size

    @property
    def start(self) -> int:
        """Where this rank's piece starts in the padded row."""
        return self.rank * self.piece

    @property
    def max_length(self) -> int:
        """The longest segment (flash attention's ``max_length_*``)."""
        return max(b - a for cuts in self.bounds for a, b in zip(cuts, cuts[1:]))

    def cu_seq_lens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The segments of all rows back to back, as cumulative lengths (flash attention's varlen
        ``cu_seq_lens_*``, int32): the layout of the whole padded rows flattened row after row."""
        cuts = [0]
        for row, row_cuts in enumerate(self.bounds):
            cuts += [row * self.length + c for c in row_cuts[1:]]
        return torch.tensor(cuts, dtype=torch.int32, device=device)


def split_sequence(rows: Mapping[str, torch.Tensor], pad: Mapping[str, int], size: int, rank: int,
                   segments: torch.Tensor | None = None, granularity: int | None = None,
                   ) -> tuple[SequencePieces, dict[str, torch.Tensor]]:
    """This rank's piece of every per-token tensor in ``rows`` (each ``(rows, width)``), and the layout.

    ``pad``: the value each tensor is padded with, one per key of ``rows`` (the targets' must be the
    ignore index, so padding never counts). ``segments``: ``(rows, width)``, the packed record each
    token belongs to (any ids, equal within a record, different between neighbours), padding -1
    or any id of its own; ``None``: each row is one record (unpacked rows; their right padding
    comes after every real token, so causal attention never lets a real token see it).
    ``granularity``: the rows are padded to a multiple of it (default ``size``; a multiple of ``size``).
    """
    granularity = granularity or size
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"context parallel rank {rank} of {size}")
    if granularity % size:
        raise ValueError(f"granularity {granularity} is not a multiple of the {size} context-parallel ranks")
    missing = set(rows) - set(pad)
    if missing:
        raise ValueError(f"no padding value for {', '.join(sorted(missing))}")
    shapes = {tuple(t.shape) for t in rows.values()} | ({tuple(segments.shape)} if segments is not None else set())
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"the rows' tensors must share one (rows, width) shape, got {sorted(shapes)}")
    n_rows, width = next(iter(shapes))
    length = -(-width // granularity) * granularity
    extra = length - width
    if segments is None:
        segments = torch.zeros(n_rows, width, dtype=torch.long)
    fill = int(segments.min()) - 1 if extra else 0  # added padding: an id no record has
    layout = SequencePieces(size, rank, width, length, _segment_bounds(
        torch.nn.functional.pad(segments, (0, extra), value=fill)))
    return layout, {name: local_piece(t, layout, 1, pad[name]) for name, t in rows.items()}


def local_piece(t: torch.Tensor, layout: SequencePieces, dim: int = 1, value: float = 0) -> torch.Tensor:
    """This rank's piece of ``t``, whose dimension ``dim`` is the rows' width: padded with ``value``
    to ``layout.length``, then cut (a view where no padding was needed)."""
    if t.shape[dim] != layout.width:
        raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor is not the rows' width {layout.width}")
    if layout.length > layout.width:
        widths = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, layout.length - layout.width]
        t = torch.nn.functional.pad(t, widths, value=value)
    return t.narrow(dim, layout.start, layout.piece)


def _segment_bounds(segments: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Per row, 0, every position where the segment id changes, and the row's width (one host sync)."""
    n_rows, width = segments.shape
    changes = (segments[:, 1:] != segments[:, :-1]).nonzero().tolist()
    cuts: list[list[int]] = [[0] for _ in range(n_rows)]
    for row, at in changes:
        cuts[row].append(at + 1)
    return tuple((*c, width) for c in cuts)


def gather_sequence(piece: torch.Tensor, layout: SequencePieces, group: dist.ProcessGroup | None = None,
                    dim: int = 1) -> torch.Tensor:
    """The whole rows back from every rank's ``piece`` (cut along ``dim``), padding removed: the
    inverse of ``split_sequence`` for one tensor. Not differentiable (for checks and logging)."""
    if layout.size == 1:
        return piece.narrow(dim, 0, layout.width)
    parts = [torch.empty_like(piece) for _ in range(layout.size)]
    dist.all_gather(parts, piece.contiguous(), group=group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, layout.width)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; the gradient passes through unchanged (see ``sum_over_group``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x`` summed over the CP group, differentiable: per-sequence sums whose terms lie in pieces on
    several ranks (DPO's log-probabilities of a sequence, a loss's token count).

    Every rank computes the same loss ``f(sum)`` from the total; the gradient that reaches each
    rank's own terms is ``f'(sum)`` unchanged (not summed over the group, as
    ``torch.distributed.nn.all_reduce`` would), so the parameters' gradients summed over the group
    (FSDP's reduction) are the gradient of ``f`` once.
    """
    return _SumOverGroup.apply(x, group)


class _SharedSum(torch.autograd.Function):
    """All-reduce (sum) forward and backward (see ``shared_sum``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def shared_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x`` summed over the CP group, for a loss of which each of the N ranks counts a share: every
    rank computes ``f(sum) / N`` (so the ranks' losses add up to ``f`` once, as the per-token losses of
    the pieces do), and the gradients of the N shares, added in backward, give each rank's own terms
    ``f'(sum)`` (the training step's objectives: a preference pair's log-probabilities). Where each
    rank computes the whole ``f(sum)`` instead, ``sum_over_group``."""
    return _SharedSum.apply(x, group)
