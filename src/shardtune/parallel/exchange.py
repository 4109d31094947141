"""Row-sharded weights used where they lie: the inputs travel to the rows, not the rows to the inputs.

A weight sharded by rows (FSDP2's ``Shard(0)``: a block of output features per rank) can serve every rank's
inputs without being gathered: the ranks' inputs (a few KB per token while generating) are all-gathered,
each rank multiplies all of them by its rows, and one all-to-all returns to each rank its outputs, every
block of them computed by its owner. Each output is the same dot product the whole weight would give.
Used by the vocabulary-parallel tables (sharded_embeddings.exchanged) and the decoder's linear layers
(exchanged_layers.py) while GRPO generates, and by frozen linear layers in training (``ExchangedLinear``:
backward runs the exchange in reverse, so the inputs' gradient moves, never the weight). Where every rank
holds every rank's inputs already (a generation whose ranks all run all of their group's rows), no input
moves: each rank's outputs are all-gathered (``replicated_linears``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn import functional as F

from shardtune.runtime import distributed


def everyones(part: torch.Tensor, fill: float, group: dist.ProcessGroup, shape: list[int] | None = None
              ) -> torch.Tensor:
    """Every rank's ``part``, stacked in rank order. The parts' shapes may differ between ranks (prompts of
    different widths in the prefill), so each is padded with ``fill`` to the largest: ``shape`` when the
    caller knows it (every rank must give the same), else found with one more collective."""
    if shape is None:
        shape = distributed.all_reduce_max_each(list(part.shape), part.device, group)
    if list(part.shape) == list(shape):
        padded = part.contiguous()
    else:
        padded = part.new_full(shape, fill)
        padded[tuple(slice(0, n) for n in part.shape)] = part
    out = part.new_empty(group.size(), *shape)
    # into one tensor: a list of outputs costs NCCL a flat buffer and a copy per call; gloo takes the ranks'
    # parts concatenated along the first dimension, not stacked
    dist.all_gather_single(out.view(group.size() * shape[0], *shape[1:]), padded, group=group)
    return out


def exchanged_linear(everyone: torch.Tensor, tokens: int, weight: torch.Tensor, bias: torch.Tensor | None,
                     rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``tokens`` outputs of a linear layer whose rows are spread as ``rows`` (each rank's count,
    in rank order), from ``everyone``: every rank's inputs (ranks, padded tokens, in features; ``everyones``),
    ``weight`` and ``bias`` this rank's rows. Returns (tokens, sum(rows))."""
    return exchanged_linears(everyone, tokens, [weight], [bias], [rows], group)[0]


def exchanged_linears(everyone: torch.Tensor, tokens: int, weights: list[torch.Tensor],
                      biases: list[torch.Tensor | None], rows: list[list[int]],
                      group: dist.ProcessGroup) -> list[torch.Tensor]:
    """``exchanged_linear`` for several layers of the same inputs (q, k and v; gate and up) in one all-to-all:
    ``weights``, ``biases`` this rank's rows of each, ``rows`` each one's row counts per rank. Each rank sends
    every rank, token by token, its rows' outputs of all the layers side by side."""
    n, padded, me = everyone.size(0), everyone.size(1), group.rank()
    flat = everyone.reshape(n * padded, -1)  # rank r's tokens at rows r·padded …
    owned = [sum(r[s] for r in rows) for s in range(n)]  # rows of all the layers each rank holds
    send = _rows_outputs(flat.new_empty(n * padded, owned[me]), flat, weights, biases, rows, me)
    received = send.new_empty(padded * sum(owned))
    dist.all_to_all_single(received, send.reshape(-1), [padded * k for k in owned], [padded * owned[me]] * n,
                           group=group)
    del send
    by_rank = [b.view(padded, k) for b, k in zip(received.split([padded * k for k in owned]), owned)]
    return [out[:tokens] for out in _per_layer(by_rank, rows)]


def replicated_linears(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                       rows: list[list[int]], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The outputs of several layers of the same inputs (q, k and v; gate and up) whose rows are spread as
    ``rows``, for inputs ``x`` (tokens, in features) that every rank of ``group`` holds alike: each rank
    multiplies them by its rows (``weights``, ``biases``) and one all-gather gives every rank all of them
    (tensor parallelism's column-parallel layer). Half the collectives of ``exchanged_linears``, which needs
    no rank to hold another's inputs. Returns each layer's (tokens, sum(rows))."""
    n, me = group.size(), group.rank()
    owned = [sum(r[s] for r in rows) for s in range(n)]
    # padded to the widest rank's: all-gather takes one shape
    send = _rows_outputs(x.new_empty(x.size(0), max(owned)), x, weights, biases, rows, me)
    received = send.new_empty(n, *send.shape)
    dist.all_gather_single(received.view(n * send.size(0), -1), send, group=group)
    del send
    return _per_layer([received[s, :, :owned[s]] for s in range(n)], rows)


def _rows_outputs(send: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor],
                  biases: list[torch.Tensor | None], rows: list[list[int]], me: int) -> torch.Tensor:
    """``send`` with each layer's outputs of ``x`` on rank ``me``'s rows written straight into their columns,
    side by side in the layers' order (columns beyond them left as they are)."""
    col = 0
    for w, b, r in zip(weights, biases, rows):
        _linear_into(send[:, col:col + r[me]], x, w, b)
        col += r[me]
    return send


def _per_layer(by_rank: list[torch.Tensor], rows: list[list[int]]) -> list[torch.Tensor]:
    """Each layer's whole outputs, from every rank's block of its rows' outputs of all the layers side by side
    (``_rows_outputs``, rank order): the layers' columns cut from each block and joined across the ranks."""
    blocks = [block.split([r[s] for r in rows], dim=1) for s, block in enumerate(by_rank)]
    return [torch.cat([block[m] for block in blocks], dim=1) for m in range(len(rows))]


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``F.linear(x, weight, bias)`` written into ``out``, a block of columns of a wider matrix: BLAS writes it
    through its leading dimension, no temporary (as sharded_embeddings._logits). A 4-bit weight goes through
    ``F.linear``, which dequantizes it, and is copied."""
    if type(weight) is not torch.Tensor:
        out.copy_(F.linear(x, weight, bias))
    elif bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def exchanged_linears_input_grad(grads: list[torch.Tensor], weights: list[torch.Tensor], rows: list[list[int]],
                                 padded: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The gradient of ``exchanged_linears``' inputs for this rank's tokens, from those of its outputs ``grads``
    (tokens, sum(rows) each): the exchange in reverse. Each rank's gradients on every owner's rows go to that
    owner (one all-to-all), which multiplies every rank's by its rows, summing over the layers; the partial sums
    go back to the tokens' ranks (a second all-to-all, each rank's tokens from every owner), where they are
    added. ``padded``: the token count every rank padded to in the forward. Returns (tokens, in features)."""
    n, me, tokens = group.size(), group.rank(), grads[0].size(0)
    # a 4-bit (NF4) weight is dequantized here, its rows only, as F.linear does it in the forward
    weights = [w if type(w) is torch.Tensor else w.get_original_weight() for w in weights]
    owned = [sum(r[s] for r in rows) for s in range(n)]
    # to each owner, every layer's gradients on its rows side by side, for this rank's tokens padded with zeros
    send = grads[0].new_empty(padded * sum(owned))
    for s, block in enumerate(send.split([padded * k for k in owned])):
        block = block.view(padded, owned[s])
        block[tokens:].zero_()
        col = 0
        for g, r in zip(grads, rows):
            first = sum(r[:s])
            block[:tokens, col:col + r[s]].copy_(g[:, first:first + r[s]])
            col += r[s]
    received = send.new_empty(n * padded * owned[me])
    dist.all_to_all_single(received, send, [padded * owned[me]] * n, [padded * k for k in owned], group=group)
    del send
    mine = received.view(n * padded, owned[me]).split([r[me] for r in rows], dim=1)
    partial = mine[0] @ weights[0]  # every rank's tokens, this rank's share of the sum
    for part, weight in zip(mine[1:], weights[1:]):
        partial.addmm_(part, weight)
    del received, mine
    back = torch.empty_like(partial)
    dist.all_to_all_single(back, partial, group=group)
    return back.view(n, padded, -1).sum(0)[:tokens]


class ExchangedLinear(torch.autograd.Function):
    """``exchanged_linears`` with a backward for the inputs: the weights and biases (this rank's rows) are
    frozen.

    ``apply(x, everyone, weights, biases, rows, group, backward_starts)``: ``x`` this rank's inputs (...,
    in features), ``everyone`` every rank's, as ``everyones`` gathered them (detached: gathered once, they may
    serve several calls); returns each layer's outputs (..., its out features). ``backward_starts``, if not
    None, is called when the backward begins: activation checkpointing's recompute stops as soon as it has
    what backward needs, before the end of the layer's forward, so what the caller keeps for the forward's
    later calls is let go there."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, everyone: torch.Tensor,
                weights: list[torch.Tensor], biases: list[torch.Tensor | None], rows: list[list[int]],
                group: dist.ProcessGroup, backward_starts: Callable[[], None] | None = None
                ) -> tuple[torch.Tensor, ...]:
        ctx.weights, ctx.rows, ctx.group, ctx.padded, ctx.shape = weights, rows, group, everyone.size(1), x.shape
        ctx.backward_starts = backward_starts
        outs = exchanged_linears(everyone, x.numel() // x.size(-1), weights, biases, rows, group)
        return tuple(out.view(*x.shape[:-1], sum(r)) for out, r in zip(outs, rows))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor) -> tuple:
        if ctx.backward_starts is not None:
            ctx.backward_starts()
        # a layer whose outputs were not used gets zeros (autograd materializes them)
        flat = [g.reshape(-1, g.size(-1)).to(ctx.weights[0].dtype) for g in grads]
        x_grad = exchanged_linears_input_grad(flat, ctx.weights, ctx.rows, ctx.padded, ctx.group)
        return x_grad.view(ctx.shape), None, None, None, None, None, None
