"""Context parallelism, the attention side: Ulysses, an all-to-all from sequence pieces to head shares.

Each rank of a CP group holds q, k, v of its piece of the sequence for all heads. One all-to-all
gives it the whole sequence for its share of the heads; it runs the ordinary single-process
attention on that (one causal attention per packed record, model/attention.py's ``record_attention``,
memory linear in the record's length), and a second all-to-all brings its piece back for all heads. What a rank
computes is exactly the one-process attention restricted to some heads, so record boundaries and
causality are honoured the same way however records fall across pieces, and the result is exact
(the same kernels on the same numbers). An all-to-all is a permutation, so its backward is the
inverse all-to-all: plain ``torch.distributed.all_to_all_single`` (gloo and NCCL), no private API.

Heads that do not divide N (SmolLM2-135M: 9 query heads, 3 key/value heads): the shares are uneven
(5 and 4 on 2 ranks), a rank's time is its share (``HeadShares.overhead``: the largest over an
even share). With grouped-query attention a rank receives the key/value heads its query heads use,
so a key/value head whose group is cut between two ranks goes to both (its gradients are summed);
``head_shares`` cuts where that costs least memory among the cuts that are fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.distributed as dist

from shardtune.model.attention import record_attention
from shardtune.parallel.context_parallel import SequencePieces

__all__ = ["HeadShares", "PieceAttention", "head_shares", "record_attention", "ulysses_attention"]

#: ``attend(q, k, v, bounds, scale)``: the single-process attention over whole rows, per record
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[Sequence[int]], float | None], torch.Tensor]
Ranges = tuple[tuple[int, int], ...]  # one [start, stop) of heads per rank


@dataclass(frozen=True)
class HeadShares:
    """Which heads each of N ranks attends: query heads ``[cuts[r], cuts[r + 1])``, and the key/value
    heads those use (query head h uses key/value head ``h // group``)."""

    heads: int
    kv_heads: int
    cuts: tuple[int, ...]  # N + 1 query-head cuts, 0 ... heads

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @cached_property
    def q(self) -> Ranges:
        return tuple(zip(self.cuts, self.cuts[1:]))

    @cached_property
    def kv(self) -> Ranges:
        return tuple(_kv_range(a, b, self.group) for a, b in self.q)

    @property
    def overhead(self) -> float:
        """Attention time lost to uneven shares: the largest share over an even one, less one."""
        return max(b - a for a, b in self.q) * len(self.q) / self.heads - 1

    @property
    def most_heads(self) -> int:
        """The most heads (query + key + value) one rank holds over the whole sequence: what SDPA
        saves for backward per layer is these heads over the whole sequence, on the busiest rank."""
        return max(_held(q, kv) for q, kv in zip(self.q, self.kv))


def _kv_range(a: int, b: int, group: int) -> tuple[int, int]:
    return (a // group, -(-b // group)) if b > a else (0, 0)


def _held(q: tuple[int, int], kv: tuple[int, int]) -> int:
    return q[1] - q[0] + 2 * (kv[1] - kv[0])


@lru_cache(maxsize=64)  # every layer of every forward asks
def head_shares(heads: int, kv_heads: int, size: int) -> HeadShares:
    """The cuts of the query heads over ``size`` ranks: shares of at most ``ceil(heads / size)``
    heads (the fastest), and among those the cuts whose busiest rank holds the fewest heads
    (query + key/value, ``HeadShares.most_heads``); ties to the earliest cuts."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads or size < 1:
        raise ValueError(f"{heads} attention heads are not a whole number of groups of {kv_heads} key/value heads")
    group, most = heads // kv_heads, -(-heads // size)
    # best[r][c]: (most heads held by one of the first r ranks, cut before) when they take query heads [0, c)
    best: list[dict[int, tuple[int, int]]] = [{0: (0, 0)}]
    for _ in range(size):
        best.append({})
        for c in range(heads + 1):
            options = [(max(best[-2][a][0], _held((a, c), _kv_range(a, c, group))), a)
                       for a in range(max(0, c - most), c + 1) if a in best[-2]]
            if options:
                best[-1][c] = min(options)
    cuts = [heads]
    for r in range(size, 0, -1):
        cuts.append(best[r][cuts[-1]][1])
    return HeadShares(heads, kv_heads, tuple(reversed(cuts)))


# --- the two all-to-alls ---------------------------------------------------------------------------


def _to_heads(parts: Sequence[torch.Tensor], ranges: Sequence[Ranges], rank: int,
              group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Sequence pieces -> head shares. ``parts[i]``: ``(b, heads_i, piece, d)``, this rank's piece;
    ``ranges[i][j]``: the heads of part i that rank j gets. Returns, per part, ``(b, heads, N * piece,
    d)``: this rank's heads over the whole sequence (rank j's piece is the j-th part of it)."""
    b, _, piece, d = parts[0].shape
    n = len(ranges[0])
    send = torch.cat([p[:, lo:hi].transpose(0, 1) for j in range(n) for p, (lo, hi) in
                      zip(parts, (r[j] for r in ranges))])  # (heads for rank 0, then 1..., b, piece, d)
    mine = [hi - lo for lo, hi in (r[rank] for r in ranges)]
    recv = send.new_empty((n * sum(mine), b, piece, d))
    counts = [sum(hi - lo for lo, hi in (r[j] for r in ranges)) for j in range(n)]
    dist.all_to_all_single(recv, send, [sum(mine)] * n, counts, group=group)
    del send
    whole = recv.view(n, sum(mine), b, piece, d).permute(2, 1, 0, 3, 4).reshape(b, sum(mine), n * piece, d)
    return list(whole.split(mine, dim=1))


def _to_seq(wholes: Sequence[torch.Tensor], ranges: Sequence[Ranges], heads: Sequence[int], rank: int,
            group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Head shares -> sequence pieces, the inverse (and the adjoint) of ``_to_heads``: per part,
    ``(b, heads[i], piece, d)``; a head that went to several ranks gets the sum of what they return."""
    b, _, seq, d = wholes[0].shape
    n = len(ranges[0])
    piece = seq // n
    mine = sum(w.shape[1] for w in wholes)
    send = torch.cat([w.reshape(b, w.shape[1], n, piece, d).permute(2, 1, 0, 3, 4) for w in wholes], dim=1)
    counts = [sum(hi - lo for lo, hi in (r[j] for r in ranges)) for j in range(n)]
    recv = send.new_empty((sum(counts), b, piece, d))
    dist.all_to_all_single(recv, send.reshape(n * mine, b, piece, d), counts, [mine] * n, group=group)
    del send
    out = [recv.new_zeros((h, b, piece, d)) for h in heads]
    at = 0
    for j in range(n):
        for o, (lo, hi) in zip(out, (r[j] for r in ranges)):
            o[lo:hi] += recv[at:at + hi - lo]
            at += hi - lo
    return [o.transpose(0, 1) for o in out]


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ranges: Sequence[Ranges], rank: int, group: dist.ProcessGroup | None,  # type: ignore[override]
                *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = ranges, [p.shape[1] for p in parts], rank, group
        return tuple(_to_heads(parts, ranges, rank, group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        ranges, heads, rank, group = ctx.args
        return (None, None, None, *_to_seq(grads, ranges, heads, rank, group))


class _ToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ranges: Sequence[Ranges], heads: Sequence[int], rank: int,  # type: ignore[override]
                group: dist.ProcessGroup | None, *wholes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = ranges, rank, group
        return tuple(_to_seq(wholes, ranges, heads, rank, group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        ranges, rank, group = ctx.args
        return (None, None, None, None, *_to_heads(grads, ranges, rank, group))


# --- the attention ---------------------------------------------------------------------------------


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequencePieces,
                      group: dist.ProcessGroup | None = None, scale: float | None = None,
                      attend: Attend = record_attention) -> torch.Tensor:
    """Attention of this rank's piece against the whole sequence, in transformers' layout:
    ``q`` ``(rows, heads, piece, dim)``, ``k``/``v`` ``(rows, kv_heads, piece, dim)`` -> ``(rows, heads,
    piece, dim)``. ``layout``: what ``split_sequence`` returned on this rank; ``group``: the CP
    group (all its ranks call this together, as any collective); ``attend``: the single-process
    attention over whole rows and their segments (records never see each other)."""
    if q.shape[2] != layout.piece or k.shape[2] != layout.piece:
        raise ValueError(f"q/k/v hold {q.shape[2]} positions; this rank's piece is {layout.piece}")
    if layout.size == 1:
        return attend(q, k, v, layout.bounds, scale)
    if dist.get_world_size(group) != layout.size:
        raise ValueError(f"the sequence is cut for {layout.size} ranks; the group has {dist.get_world_size(group)}")
    shares = head_shares(q.shape[1], k.shape[1], layout.size)
    rank = layout.rank
    wq, wk, wv = _ToHeads.apply((shares.q, shares.kv, shares.kv), rank, group, q, k, v)
    out = _attend_share(wq, wk, wv, shares.q[rank], shares.group, layout.bounds, scale, attend)
    return _ToSeq.apply((shares.q,), (q.shape[1],), rank, group, out)[0]


def _attend_share(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int], group: int,
                  bounds: Sequence[Sequence[int]], scale: float | None, attend: Attend) -> torch.Tensor:
    """``attend`` on a rank's share, query heads ``heads`` (global numbers) and the key/value heads
    they use: in runs where every key/value head serves the same number of query heads (a share may
    start or end partway into a group)."""
    lo, hi = heads
    if hi == lo:  # more ranks than heads: nothing to attend here, but the exchange goes on
        return q * 0
    runs, a = [], lo
    while a < hi:  # whole groups from a group's start, else the rest of the group a is in
        b = a + (hi - a) // group * group if a % group == 0 and hi - a >= group else min(hi, (a // group + 1) * group)
        runs.append((a, b))
        a = b
    kv_sizes = [-(-b // group) - a // group for a, b in runs]
    outs = [attend(qs, ks, vs, bounds, scale) for qs, ks, vs in
            zip(q.split([b - a for a, b in runs], 1), k.split(kv_sizes, 1), v.split(kv_sizes, 1))]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


@dataclass(frozen=True)
class PieceAttention:
    """What a context-parallel forward gives the model's attention (``shardtune_cp``, model/attention.py):
    this rank's layout of the micro-batch and its CP group; called per layer with q, k, v of the piece."""

    layout: SequencePieces
    group: dist.ProcessGroup | None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                 attend: Attend = record_attention) -> torch.Tensor:
        return ulysses_attention(q, k, v, self.layout, self.group, scale, attend)
