"""The token counts the ranks of a shard group agree on for one training forward, in one all-reduce.

Three parts of a forward pad every rank's tokens to the largest count of any rank of the group: the row-sharded
embedding's lookup and the loss head, where they exchange tokens (sharded_embeddings.exchange_size), and the
exchanged decoder layers (exchanged_layers ``_Pass``). Each learned its count with an all-reduce of one number
read on the host: up to three meetings of the ranks per forward, and on a GPU as many host syncs, the head's
after the whole forward was queued, so the host waited for the GPU to run it before it could queue the head and
the backward, and the GPU then waited for the host.

Both counts are known on the host before the forward starts: the tokens (the input ids, which the lookup and
every projection see) and the positions the loss head scores (train/loss_head.py ``score``). ``forward`` records
them for one forward; the first part that asks (``most``: the lookup, at the forward's start) agrees on both in
one all-reduce, and the later ones read the answer. Every rank runs the same parts in the same order, so the
ranks meet at the same call, and where no part asks (DDP, FSDP1, unsharded tables) nothing is agreed on at all.
Outside ``forward`` (generation, a forward that does not score) each part asks for its own count as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardtune.runtime import distributed

#: what a part counts: "tokens", every position of the input; "scored", the positions the loss head scores
KINDS = ("tokens", "scored")


@dataclass
class _Forward:
    local: dict[str, int]  # this rank's counts, by kind
    agreed: dict[str, int] = field(default_factory=dict)  # every rank's largest, once asked
    group: dist.ProcessGroup | None = None  # the group they were agreed over


_current: list[_Forward] = []  # the innermost forward being scored, last


@contextlib.contextmanager
def forward(tokens: int, scored: int) -> Iterator[None]:
    """This rank's counts for the forward run inside: ``tokens`` input positions, ``scored`` of them scored."""
    _current.append(_Forward({"tokens": tokens, "scored": scored}))
    try:
        yield
    finally:
        _current.pop()


def most(kind: str, local: int, device: torch.device, group: dist.ProcessGroup) -> int:
    """The largest count of ``kind`` over ``group``'s ranks, which ``local`` (this rank's) pads to: inside
    ``forward``, both kinds agreed on at the first call and read after it; outside, one all-reduce for this one."""
    if kind not in KINDS:
        raise ValueError(f"unknown count {kind!r}: one of {KINDS}")
    fwd = _current[-1] if _current else None
    if fwd is None or (fwd.agreed and fwd.group is not group):
        return distributed.all_reduce_max(local, device, group)
    if not fwd.agreed:
        values = distributed.all_reduce_max_each([fwd.local[k] for k in KINDS], device, group)
        fwd.agreed, fwd.group = dict(zip(KINDS, values)), group
    if local > fwd.agreed[kind]:  # a part that counts what the forward's record does not: padding would cut it
        raise RuntimeError(f"agreed counts: {local} {kind} on this rank, more than the {fwd.agreed[kind]} agreed on "
                           "for this forward from the counts recorded before it (agreed_counts.forward)")
    return fwd.agreed[kind]
