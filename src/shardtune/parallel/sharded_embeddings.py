"""Frozen embeddings used straight from row shards: one owner's rows at a time, or the tokens exchanged.

Under FSDP the embeddings are all-gathered whole on every rank, into a buffer and then a copy:
vocabulary × hidden × 2 (250 MB for a 32k × 2048 bf16 table, 2 GB for Llama-3-8B's 128k × 4096),
the largest transients of a LoRA step: the input table at the start of forward, the output one
from the end of forward into backward. Frozen tables need none of FSDP's gradient machinery, so
here each rank keeps its rows (a DTensor sharded on dim 0, left out of FSDP) and every use goes
through the ranks' rows in turn, each broadcast into one reused buffer: the lookup takes the ids
that fall in those rows, the output projection computes that slice of the logits, and its backward
(the hidden states' gradient) broadcasts the rows again. Held at once: one rank's rows; moved: the
same bytes as FSDP's all-gather. Tied embeddings share one sharded weight.

A step of few tokens (GRPO's: a few hundred a rank) against a large table would spend its time moving the
rows, so in training (and scoring) the lookup and the loss head (train/loss_head.py) choose, per call, the
cheaper way by one rule (``exchange_cheaper``; the planner, train/memory_model.py, applies it too):
broadcasting the rows moves (ranks - 1) / ranks x vocabulary x hidden per pass, exchanging the tokens about
(ranks - 1) x tokens x hidden (the hidden states gathered, the hidden states' gradient sent back), counted on
the most tokens any rank has (agreed on by every rank, so every rank chooses alike: agreed_counts.py). Exchanged, every
rank's tokens are gathered and each rank computes on its own rows: the lookup sends each rank its embeddings
(one owner's row plus zeros: exact); the loss head gathers every rank's per-token statistics (max, sum of exp,
target logit, best token) and merges them as its stream of blocks does, and sums each rank's share of the
derivative at the token's owner: the same numbers up to summation order, and no rows moved. More tokens are
exchanged a piece at a time, each piece's buffers no larger than the one rank's rows a broadcast holds. The
full logits (``_ShardedLinear``, where the loss head does not score) are always made from broadcast rows:
exchanging them moves tokens x vocabulary, cheaper only below about hidden tokens a rank, and they are off the
training path of SFT, DPO and GRPO.

Generating token by token, every forward would move the whole table again (twice when tied: the
lookup and the logits). Inside ``exchanged`` (GRPO's generation, where every rank generates its own rows
in lockstep) the tables are used vocabulary-parallel instead and never gathered: the ranks' token ids and
last hidden states (a few KB) are all-gathered, each rank looks up and projects them on its own rows, and
one all-to-all returns to each rank its embeddings (a sum in which one owner's row meets zeros: exact)
and its logits, each rank's block of the vocabulary computed by its owner. Held: the rank's rows, as in
training; moved per token: the logits once, not the table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardtune.parallel import agreed_counts
from shardtune.parallel.exchange import everyones as _everyones
from shardtune.parallel.exchange import exchanged_linear, replicated_linears


def row_counts(total: int, world: int) -> list[int]:
    """Rows per rank under Shard(0): torch.chunk's split, empty shards at the end when rows run out."""
    chunk = -(-total // world)
    return [max(0, min(chunk, total - r * chunk)) for r in range(world)]


def shard_rows(weight: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
    """This rank's rows of ``weight`` (on meta or not) as a frozen DTensor parameter, Shard(0).

    ``mesh`` is 1-D: under HSDP, the shard group's mesh (``parallel.mesh.shard_mesh``).
    """
    if mesh.ndim != 1:
        raise ValueError(f"row sharding needs a 1-D mesh (the shard group), got a {mesh.ndim}-D one")
    group = mesh.get_group()
    # torch.chunk, as FSDP2 splits: a 4-bit (NF4) weight splits by whole blocks, it cannot be sliced
    chunks = weight.detach().chunk(group.size())
    local = chunks[group.rank()] if group.rank() < len(chunks) else weight.detach()[weight.size(0):]
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=weight.shape,
                                 stride=weight.stride())
    return nn.Parameter(sharded, requires_grad=False)


class ShardedEmbedding(nn.Module):
    """Drop-in for a frozen ``nn.Embedding`` whose ``weight`` is row-sharded (``shard_rows``)."""

    def __init__(self, embed: nn.Embedding, weight: nn.Parameter, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embed.num_embeddings, embed.embedding_dim
        self.padding_idx = embed.padding_idx
        self.weight, self.group = weight, group
        self.rows = row_counts(self.num_embeddings, group.size())
        self.exchange = False  # inside ``exchanged``: every rank's ids looked up on the rows here
        self.replicated = False  # and every rank holds them all already

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.exchange:
            return _exchanged_lookup(self, ids)
        # Exchanged when that is cheaper (a few tokens, a large table)
        size = exchange_size(self, ids.numel(), lookup_cost(self.embedding_dim, self.weight.to_local().element_size()))
        if size is not None:
            return _lookup_exchanging(self, ids, size)
        # No host sync in the lookup (no ids.min()/max(), no boolean-mask indexing): each owner's rows are
        # looked up for every id, clamped, and kept where the id is one of them. Token ids were
        # checked against the vocabulary when the data was loaded (train/data.py); an id outside it
        # would give zeros here, not an error.
        local = self.weight.to_local()
        out = local.new_zeros(*ids.shape, self.embedding_dim)
        for start, rows in _blocks(self):
            shifted = ids - start
            mine = (shifted >= 0) & (shifted < len(rows))
            picked = nn.functional.embedding(shifted.clamp(0, len(rows) - 1), rows)
            out = torch.where(mine.unsqueeze(-1), picked, out)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows per rank={self.rows}"


class ShardedHead(nn.Module):
    """Drop-in for a bias-free frozen ``nn.Linear`` whose ``weight`` is row-sharded (``shard_rows``)."""

    def __init__(self, head: nn.Linear, weight: nn.Parameter, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight, self.group = weight, group
        self.rows = row_counts(self.out_features, group.size())
        self.exchange = False  # inside ``exchanged``: every rank's hidden states projected on the rows here
        self.replicated = False  # and every rank holds them all already

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.exchange and not torch.is_grad_enabled():  # generating: no backward to prepare
            return _exchanged_logits(self, hidden)
        return _ShardedLinear.apply(hidden, self.weight.to_local(), self.rows, self.group)

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of each rank's block of the vocabulary in turn; a collective (see
        ``_each_owners_rows``): for the loss head (train/loss_head.py), which never makes all the logits."""
        return _blocks(self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows per rank={self.rows}"


@contextlib.contextmanager
def exchanged(model: nn.Module, replicated: bool = False) -> Iterator[None]:
    """Each row-sharded table of ``model`` used vocabulary-parallel until the block ends (module doc): every
    forward inside is a collective, so every rank runs each one, with as many tokens (generation's lockstep,
    every rank's prompts padded alike). ``replicated``: every rank's forwards carry the same tokens (each runs
    every rank's rows), so nothing is gathered: the lookups are summed, the logits all-gathered."""
    modules = [m for m in model.modules() if isinstance(m, (ShardedEmbedding, ShardedHead))]
    try:
        for m in modules:
            m.exchange, m.replicated = True, replicated
        yield
    finally:
        for m in modules:
            m.exchange, m.replicated = False, False


def _blocks(module: ShardedEmbedding | ShardedHead) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of each rank's block in turn, broadcast from their owners (a collective)."""
    return _each_owners_rows(module.weight.to_local(), module.rows, module.group)


def _exchanged_lookup(module: ShardedEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """``ids``' embeddings: every rank's ids (as many on each: ``exchanged``) looked up on the rows here, and each
    rank's own sent back."""
    group = module.group
    local = module.weight.to_local()
    first = sum(module.rows[:group.rank()])  # this rank's first row
    if module.replicated:  # every rank's ids are these: each rank's rows looked up, summed
        out = _picked(local, ids - first, module.embedding_dim)
        dist.all_reduce(out, group=group)
        return out
    everyone = _everyones(ids, -1, group, shape=list(ids.shape)) - first
    received = torch.empty(*everyone.shape, module.embedding_dim, dtype=local.dtype, device=local.device)
    dist.all_to_all_single(received, _picked(local, everyone, module.embedding_dim), group=group)
    return received.sum(0)[:ids.size(0), :ids.size(1)]


def _picked(local: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """The rows here of ``ids`` (shifted to this rank's first row), zeros where an id is not one of them."""
    mine = (ids >= 0) & (ids < local.size(0))
    picked = nn.functional.embedding(ids.clamp(0, max(local.size(0) - 1, 0)), local) if local.size(0) \
        else local.new_zeros(*ids.shape, width)
    return torch.where(mine.unsqueeze(-1), picked, 0.0)


def _exchanged_logits(module: ShardedHead, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden``'s logits: every rank's hidden states times the rows here, then each rank's columns back."""
    local = module.weight.to_local()
    flat = hidden.reshape(-1, hidden.size(-1)).to(local.dtype)
    if module.replicated:  # every rank's hidden states are these: each rank's block of the logits all-gathered
        out = replicated_linears(flat, [local], [None], [module.rows], module.group)[0]
        return out.view(*hidden.shape[:-1], sum(module.rows))
    out = exchanged_linear(_everyones(flat, 0.0, module.group, shape=list(flat.shape)), flat.size(0), local, None,
                           module.rows, module.group)
    return out.view(*hidden.shape[:-1], sum(module.rows))


def _each_owners_rows(local: torch.Tensor, rows: list[int],
                      group: dist.ProcessGroup) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row index, that rank's rows) for each rank holding rows, in rank order, on every rank.

    A collective: each rank's rows are broadcast into one buffer, reused for the next rank, so the
    view yielded is valid only until the loop moves on.
    """
    buffer = local.new_empty(max(rows), local.size(-1))
    start = 0
    for owner, n in enumerate(rows):
        if n:
            view = buffer[:n]
            if group.rank() == owner:
                view.copy_(local)
            dist.broadcast(view, src=dist.get_global_rank(group, owner), group=group)
            yield start, view
        start += n


class _ShardedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, local: torch.Tensor, rows: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(local)
        ctx.rows, ctx.group, ctx.hidden_dtype = rows, group, hidden.dtype
        return _logits(hidden.to(local.dtype), _each_owners_rows(local, rows, group), rows)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (local,) = ctx.saved_tensors
        rows, group = ctx.rows, ctx.group
        grad_out = grad_out.to(local.dtype)
        flat = grad_out.reshape(-1, grad_out.size(-1))
        grad = flat.new_zeros(flat.size(0), local.size(-1))
        for start, owned in _each_owners_rows(local, rows, group):
            grad.addmm_(flat[:, start:start + len(owned)], owned)  # accumulates in place: no temporary
        return grad.view(*grad_out.shape[:-1], local.size(-1)).to(ctx.hidden_dtype), None, None, None


def _logits(x: torch.Tensor, blocks: Iterator[tuple[int, torch.Tensor]], rows: list[int]) -> torch.Tensor:
    """``x`` times the table's rows, given as ``blocks``: each block's logits go straight into their columns
    of the output (a strided out= that BLAS writes through its leading dimension): a temporary of one
    block's logits, copied there, was the largest transient at the logits (2048 tokens x 64k rows of a
    128k vocabulary: 512 MB fp32)."""
    flat = x.reshape(-1, x.size(-1))
    out = x.new_empty(flat.size(0), sum(rows))
    for start, owned in blocks:
        torch.mm(flat, owned.T, out=out[:, start:start + len(owned)])
    return out.view(*x.shape[:-1], sum(rows))


# --- training: vocabulary-parallel where that moves fewer bytes than the table (module doc) -----------------

class ExchangeCost(NamedTuple):
    """What exchanging costs per token of a rank, in bytes: ``moved`` to and from the other ranks (what the
    choice weighs against the rows), ``held`` per gathered token while a piece is worked on (what sizes the
    pieces). Each use of a table says its own: ``lookup_cost`` here, the loss head's in train/target_logprobs.py."""

    moved: int
    held: int


def lookup_cost(width: int, itemsize: int) -> ExchangeCost:
    """The lookup's: moved, the id gathered and its embedding sent back; held, the embeddings looked up here
    and those received."""
    return ExchangeCost(8 + width * itemsize, 2 * width * itemsize)


def lookup_buffers(ranks: int, piece: int, width: int, itemsize: int) -> int:
    """What an exchanged lookup (``_lookup_exchanging``) holds beside its output while a piece of ``piece``
    tokens a rank is worked on: every rank's ids of the piece and, per gathered token, ``lookup_cost``'s held
    bytes; then the piece's sum. The planner (train/memory_model.py) counts this."""
    return ranks * piece * (8 + lookup_cost(width, itemsize).held) + piece * width * itemsize


def exchange_cheaper(ranks: int, tokens: int, moved_per_token: int, table_bytes: int, passes: int = 1) -> bool:
    """The one rule of the choice, on numbers alone (``exchange_size`` applies it at run time, the planner,
    train/memory_model.py, ahead of it): exchanging ``tokens`` a rank (the most any rank has) beats broadcasting
    the rows of a table of ``table_bytes`` over ``ranks`` ranks.

    Per rank, an exchange receives (ranks - 1) x that many tokens x ``moved_per_token`` bytes (what the caller
    moves for a token to and from the other ranks); the broadcasts receive the other ranks' rows, (ranks - 1) /
    ranks x vocabulary x hidden x the table's element size, ``passes`` times. (ranks - 1) cancels. When no rank
    has a token there is nothing to exchange (the broadcasts' no-op): False."""
    return 0 < tokens and ranks * tokens * moved_per_token < passes * table_bytes


def piece_tokens(ranks: int, rows_bytes: int, held_per_token: int) -> int:
    """Tokens per rank in one exchange, so that its buffers (every rank's tokens x ``held_per_token`` bytes)
    take no more than the one rank's rows a broadcast holds (``rows_bytes``, the largest rank's)."""
    return max(1, rows_bytes // (ranks * held_per_token))


def exchange_size(module: ShardedEmbedding | ShardedHead, tokens: int, cost: ExchangeCost,
                  passes: int = 1, kind: str = "tokens") -> int | None:
    """The most tokens any rank of ``module``'s group has, when exchanging them is the cheaper way to use the
    table (``exchange_cheaper``); None when broadcasting its rows is. ``tokens`` counts positions of ``kind``
    (agreed_counts.py: the lookup's are the input's, the loss head's those it scores). Agreed on by every rank
    (agreed_counts.most: one all-reduce per forward that scores, shared with the other parts), so every rank
    chooses alike."""
    local = module.weight.to_local()
    size = agreed_counts.most(kind, tokens, local.device, module.group)
    table = sum(module.rows) * local.size(-1) * local.element_size()
    return size if exchange_cheaper(module.group.size(), size, cost.moved, table, passes) else None


def planned_piece(vocab: int, width: int, itemsize: int, ranks: int, tokens: int, cost: ExchangeCost,
                  passes: int = 1) -> int:
    """What ``exchange_size`` and then ``exchange_piece`` decide, for a table of ``vocab`` rows of ``width``
    values of ``itemsize`` bytes over ``ranks`` ranks whose most tokens are ``tokens``, without the table or a
    collective (the planner, train/memory_model.py): the tokens per rank of one exchange, 0 when the rows are
    broadcast."""
    if not exchange_cheaper(ranks, tokens, cost.moved, vocab * width * itemsize, passes):
        return 0
    return min(tokens, piece_tokens(ranks, max(row_counts(vocab, ranks)) * width * itemsize, cost.held))


def gather_tokens(part: torch.Tensor, size: int, fill: float, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``part`` (tokens, ...), each padded with ``fill`` to ``size`` tokens: (ranks, size, ...)."""
    return _everyones(part, fill, group, shape=[size, *part.shape[1:]])


def to_owners(parts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``parts`` (ranks, size, ...), this rank's results for each rank's tokens, sent to the tokens' owners:
    returns each rank's results for this rank's tokens, (ranks, size, ...) in rank order (one all-to-all)."""
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts.contiguous(), group=group)
    return out


def first_row(module: ShardedEmbedding | ShardedHead) -> int:
    """The vocabulary index of this rank's first row."""
    return sum(module.rows[:module.group.rank()])


def exchange_piece(module: ShardedEmbedding | ShardedHead, cost: ExchangeCost) -> int:
    """Tokens per rank in one exchange of ``module``'s (``piece_tokens``): more tokens are exchanged a piece
    at a time."""
    local = module.weight.to_local()
    return piece_tokens(module.group.size(), max(module.rows) * local.size(-1) * local.element_size(), cost.held)


def _lookup_exchanging(module: ShardedEmbedding, ids: torch.Tensor, size: int) -> torch.Tensor:
    """``ids``' embeddings: every rank's ids (padded with -1, an id no rank owns) looked up on the rows here,
    a piece at a time; in the sum each rank receives, one owner's row meets zeros: exact."""
    local, group = module.weight.to_local(), module.group
    flat = ids.reshape(-1)
    out = local.new_empty(flat.size(0), module.embedding_dim)
    piece = exchange_piece(module, lookup_cost(module.embedding_dim, local.element_size()))
    for a in range(0, size, piece):
        b = min(size, a + piece)
        everyone = gather_tokens(flat[a:b], b - a, -1, group) - first_row(module)
        mine = (everyone >= 0) & (everyone < local.size(0))
        picked = nn.functional.embedding(everyone.clamp(0, max(local.size(0) - 1, 0)), local) if local.size(0) \
            else local.new_zeros(*everyone.shape, module.embedding_dim)
        picked.masked_fill_(~mine.unsqueeze(-1), 0.0)
        del everyone, mine
        here = out[a:b]
        here.copy_(to_owners(picked, group).sum(0)[:here.size(0)])
    return out.view(*ids.shape, module.embedding_dim)
