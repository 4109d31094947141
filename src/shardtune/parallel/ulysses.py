"""Context parallelism, the attention side: Ulysses, an all-to-all from sequence pieces to head shares.

Each rank of a CP group holds q, k, v of its piece of the sequence for all heads. One all-to-all
gives it the whole sequence for 1/N of the heads; it runs the ordinary single-process attention on
that (one causal attention per packed record, ``record_attention``, memory linear in the record's
length), and a second all-to-all brings its piece back for all heads. The attention a rank runs is
exactly the one-process attention restricted to some heads, so record boundaries and causality are
honoured the same way, however records fall across pieces, and the result is exact (the same
kernels on the same numbers). The all-to-all is a permutation, so its backward is the inverse
all-to-all: no private torch API, plain ``torch.distributed.all_to_all_single`` (gloo and NCCL).

Heads that do not divide N (SmolLM2: 9 query heads, 3 key/value heads): the heads are padded with
dummy heads to a multiple of N, which are sent but never attended to (a rank's time is its share,
``ceil``-rounded: ``HeadLayout.overhead``). With grouped-query attention each rank must hold the
key/value heads its query heads use; key/value heads may be repeated (sent once per share of their
query group) where that pads fewer query heads: ``head_layout`` picks the repeat that leaves the
least padding, then the least repeating.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.parallel.context_parallel import SequencePieces

#: ``attend(q, k, v, bounds, scale)``: the single-process attention over whole rows, per record
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[Sequence[int]], float | None], torch.Tensor]


def record_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[Sequence[int]],
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of each segment of each row on its own: ``(rows, heads, seq, dim)`` in and out,
    ``bounds[row]`` the cuts between the row's segments (0, ..., seq). No mask is built: SDPA's flash
    kernel (CPU and CUDA) with ``is_causal`` keeps memory linear in the segment's length; ``k``/``v``
    may have fewer heads than ``q`` (grouped-query attention, ``enable_gqa``)."""
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for row, cuts in enumerate(bounds):
        parts = [F.scaled_dot_product_attention(q[row:row + 1, :, a:b], k[row:row + 1, :, a:b], v[row:row + 1, :, a:b],
                                                is_causal=True, scale=scale, enable_gqa=gqa)
                 for a, b in zip(cuts, cuts[1:])]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


@dataclass(frozen=True)
class HeadLayout:
    """How the heads are shared over N ranks: key/value heads repeated ``repeat`` times each, padded
    with dummies to ``kv_heads_padded`` (a multiple of N); query heads likewise, ``group`` per sent
    key/value head. Query head h uses sent key/value head ``h // group`` before and after padding."""

    heads: int
    kv_heads: int
    size: int
    repeat: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads // self.repeat

    @property
    def kv_heads_padded(self) -> int:
        return -(-self.kv_heads * self.repeat // self.size) * self.size

    @property
    def heads_padded(self) -> int:
        return self.kv_heads_padded * self.group

    @property
    def heads_per_rank(self) -> int:
        return self.heads_padded // self.size

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_heads_padded // self.size

    @property
    def overhead(self) -> float:
        """The attention time lost to padding: a rank's share over an even share of the heads, less one."""
        return self.heads_per_rank * self.size / self.heads - 1

    def real_kv_heads(self, rank: int) -> int:
        """The key/value heads of ``rank``'s share that are not dummies."""
        return max(0, min(self.kv_heads_per_rank, self.kv_heads * self.repeat - rank * self.kv_heads_per_rank))


def head_layout(heads: int, kv_heads: int, size: int) -> HeadLayout:
    """The head sharing over ``size`` ranks that pads the fewest query heads, then repeats the least."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} attention heads are not a whole number of groups of {kv_heads} key/value heads")
    per_kv = heads // kv_heads
    options = [HeadLayout(heads, kv_heads, size, f) for f in range(1, per_kv + 1) if per_kv % f == 0]
    return min(options, key=lambda o: (o.heads_padded, o.repeat))


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``(b, N, c, piece, d)``, chunk j of dim 1 for rank j -> ``(b, c, N * piece, d)``: this rank's
    head chunk over the whole sequence (rank j's piece is the j-th part of the sequence)."""
    b, n, c, piece, d = x.shape
    send = x.transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, c, n * piece, d)


def _heads_to_seq(y: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``(b, c, N * piece, d)`` -> ``(b, N, c, piece, d)``: this rank's piece for every rank's head chunk."""
    b, c, seq, d = y.shape
    send = y.reshape(b, c, size, seq // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1)


class _SeqToHeads(torch.autograd.Function):
    """``_seq_to_heads``, differentiable: an all-to-all is a permutation, its backward the inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.size = group, x.shape[1]
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _heads_to_seq(grad, ctx.size, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """``_heads_to_seq``, differentiable."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _heads_to_seq(y, size, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _seq_to_heads(grad, ctx.group), None, None


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, 0, 0, heads - x.shape[1])) if heads > x.shape[1] else x


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequencePieces,
                      group: dist.ProcessGroup | None = None, scale: float | None = None,
                      attend: Attend = record_attention) -> torch.Tensor:
    """Attention of this rank's piece against the whole sequence, in transformers' layout:
    ``q`` ``(rows, heads, piece, dim)``, ``k``/``v`` ``(rows, kv_heads, piece, dim)`` -> ``(rows, heads,
    piece, dim)``. ``layout``: what ``split_sequence`` returned on this rank; ``group``: the CP
    group (every rank of it calls this together, as for any collective); ``attend``: the
    single-process attention over whole rows and their segments (records never see each other)."""
    if q.shape[2] != layout.piece or k.shape[2] != layout.piece:
        raise ValueError(f"q/k/v hold {q.shape[2]} positions; this rank's piece is {layout.piece}")
    if layout.size == 1:
        return attend(q, k, v, layout.bounds, scale)
    heads = head_layout(q.shape[1], k.shape[1], layout.size)
    n, b, piece, d = layout.size, q.shape[0], layout.piece, q.shape[3]
    if heads.repeat > 1:
        k, v = k.repeat_interleave(heads.repeat, dim=1), v.repeat_interleave(heads.repeat, dim=1)
    hq, hk = heads.heads_per_rank, heads.kv_heads_per_rank
    q, k, v = _pad_heads(q, hq * n), _pad_heads(k, hk * n), _pad_heads(v, hk * n)
    # One exchange for q, k and v: rank j's chunk is its query heads, then its key and value heads.
    shares = torch.cat([t.reshape(b, n, -1, piece, d) for t in (q, k, v)], dim=2)
    whole = _SeqToHeads.apply(shares, group)  # (b, hq + 2 hk, seq, d): the whole sequence, this rank's heads
    real_kv = heads.real_kv_heads(layout.rank)
    real_q = real_kv * heads.group
    if real_q:
        out = attend(whole[:, :real_q], whole[:, hq:hq + real_kv], whole[:, hq + hk:hq + hk + real_kv],
                     layout.bounds, scale)
        out = _pad_heads(out, hq)
    else:  # only dummy heads here (more ranks than heads): nothing to attend, but join the exchange
        out = whole[:, :hq] * 0
    back = _HeadsToSeq.apply(out, n, group)  # (b, N, hq, piece, d)
    return back.reshape(b, n * hq, piece, d)[:, :heads.heads]
