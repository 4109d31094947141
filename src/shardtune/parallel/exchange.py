"""Row-sharded weights used where they lie: the inputs travel to the rows, not the rows to the inputs.

A weight sharded by rows (FSDP2's ``Shard(0)``: a block of output features per rank) can serve every rank's
inputs without being gathered: the ranks' inputs (a few KB per token while generating) are all-gathered,
each rank multiplies all of them by its rows, and one all-to-all returns to each rank its outputs, every
block of them computed by its owner. Each output is the same dot product the whole weight would give.
Used by the vocabulary-parallel tables (sharded_embeddings.exchanged) and the decoder's linear layers
(exchanged_layers.py) while GRPO generates, and by frozen linear layers in training (``ExchangedLinear``:
backward runs the exchange in reverse, so the inputs' gradient moves, never the weight).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F


def everyones(part: torch.Tensor, fill: float, group: dist.ProcessGroup, shape: list[int] | None = None
              ) -> torch.Tensor:
    """Every rank's ``part``, stacked in rank order. The parts' shapes may differ between ranks (prompts of
    different widths in the prefill), so each is padded with ``fill`` to the largest: ``shape`` when the
    caller knows it (every rank must give the same), else found with one more collective."""
    if shape is None:
        size = torch.tensor(part.shape, device=part.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
        shape = size.tolist()
    if list(part.shape) == list(shape):
        padded = part.contiguous()
    else:
        padded = part.new_full(shape, fill)
        padded[tuple(slice(0, n) for n in part.shape)] = part
    out = part.new_empty(group.size(), *shape)
    dist.all_gather(list(out.unbind(0)), padded, group=group)  # the one spelling torch 2.11-2.13 share
    return out


def exchanged_linear(everyone: torch.Tensor, tokens: int, weight: torch.Tensor, bias: torch.Tensor | None,
                     rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``tokens`` outputs of a linear layer whose rows are spread as ``rows`` (each rank's count,
    in rank order), from ``everyone``: every rank's inputs (ranks, padded tokens, in features; ``everyones``),
    ``weight`` and ``bias`` this rank's rows. Returns (tokens, sum(rows))."""
    n, padded = everyone.size(0), everyone.size(1)
    send = F.linear(everyone.reshape(n * padded, -1), weight, bias)  # rank r's tokens from r * padded
    received = send.new_empty(padded * sum(rows))
    dist.all_to_all_single(received, send.reshape(-1), [padded * r for r in rows], [padded * weight.size(0)] * n,
                           group=group)
    del send
    blocks = [b.view(padded, -1) for b in received.split([padded * r for r in rows])]
    return torch.cat(blocks, dim=1)[:tokens]


def exchanged_linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, rows: list[int], padded: int,
                                group: dist.ProcessGroup) -> torch.Tensor:
    """The gradient of ``exchanged_linear``'s inputs for this rank's tokens, from that of its outputs ``grad``
    (tokens, sum(rows)): the exchange in reverse. Each rank's gradient on every owner's rows goes to that owner
    (one all-to-all), which multiplies every rank's by its rows; the partial sums go back to the tokens' ranks
    (a second all-to-all, each rank's tokens from every owner), where they are added. ``padded``: the token
    count every rank padded to in the forward. Returns (tokens, in features)."""
    n, me, tokens = group.size(), group.rank(), grad.size(0)
    if tokens != padded:
        grad = torch.cat([grad, grad.new_zeros(padded - tokens, grad.size(1))])
    send = torch.cat([block.reshape(-1) for block in grad.split(rows, dim=1)])  # owner r's columns, in rank order
    received = grad.new_empty(n * padded * rows[me])
    dist.all_to_all_single(received, send, [padded * rows[me]] * n, [padded * r for r in rows], group=group)
    partial = received.view(n * padded, rows[me]) @ weight  # every rank's tokens, this rank's share of the sum
    del received
    back = torch.empty_like(partial)
    dist.all_to_all_single(back, partial, group=group)
    return back.view(n, padded, -1).sum(0)[:tokens]


class ExchangedLinear(torch.autograd.Function):
    """``exchanged_linear`` with a backward for the inputs: the weight and bias (this rank's rows) are frozen.

    ``apply(x, everyone, weight, bias, rows, group)``: ``x`` this rank's inputs (..., in features), ``everyone``
    every rank's, as ``everyones`` gathered them (detached: gathered once, it may serve several layers)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, everyone: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, rows: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.weight, ctx.rows, ctx.group, ctx.padded, ctx.shape = weight, rows, group, everyone.size(1), x.shape
        out = exchanged_linear(everyone, x.numel() // x.size(-1), weight, bias, rows, group)
        return out.view(*x.shape[:-1], sum(rows))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        flat = grad.reshape(-1, grad.size(-1)).to(ctx.weight.dtype)
        x_grad = exchanged_linear_input_grad(flat, ctx.weight, ctx.rows, ctx.padded, ctx.group)
        return x_grad.view(ctx.shape), None, None, None, None, None
