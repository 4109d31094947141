"""Each target token's log-probability from the hidden states and the head's vocabulary, never the full logits.

The loss head (loss_head.py) hands its hidden states and targets here, with the head's vocabulary in blocks,
and gets back log p(target) per token and whether the target is the most likely token, computed a chunk of
tokens at a time (``TargetLogProbs``):

* forward, per chunk: the chunk's logits (in the compute dtype, as the model's own head), in fp32 the
  log-sum-exp, the target's logit and whether it is the most likely token; and, when a gradient will be
  needed, the derivative of log p(target) with respect to the chunk's hidden states,
  ``W[target] − softmax · W`` (with Gemma's softcapping its chain rule), written in the compute dtype;
* backward: that derivative times the incoming gradient. No logits are recomputed or kept: the head
  costs the same two matmuls as an ordinary head and its backward, and holds one chunk of logits.

The vocabulary comes in blocks: the whole weight of an ``nn.Linear`` head (FSDP1's root unit, DDP,
single, FSDP2's gathered head), or each rank's rows of FSDP2's row-sharded head in turn
(parallel/sharded_embeddings.py: one broadcast per block, once per forward, none in backward), merged
by a running log-sum-exp. With few tokens against that head's rows (GRPO's steps; the rule is
``sharded_embeddings.exchange_cheaper``, with this head's ``scoring_cost``) the rows stay put instead: every
rank's tokens are scored on each rank's own rows, and each token's per-rank statistics merged as the blocks'
are (``ExchangedTargetLogProbs``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.model.head import Transform
from shardtune.parallel import sharded_embeddings as sharded
from shardtune.parallel.sharded_embeddings import ShardedHead
from shardtune.train.data.records import IGNORE


def _apply(z: torch.Tensor, t: Transform) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's transformation of fp32 logits ``z``, and d(transformed)/dz where it is not a constant."""
    if t.scale != 1.0:
        z = z.mul_(t.scale)
    if t.softcap is None:
        return z, None
    th = z.div_(t.softcap).tanh_()
    slope = 1 - th * th
    return th.mul_(t.softcap), slope


class _Running:
    """Per-token state while the vocabulary's blocks pass: running max and sum of exp (log-sum-exp), the
    target's logit, and the best logit and its token."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.m = torch.full((n,), float("-inf"), device=device)
        self.s = torch.zeros(n, device=device)
        self.picked = torch.zeros(n, device=device)
        self.best = torch.full((n,), float("-inf"), device=device)
        self.arg = torch.full((n,), -1, dtype=torch.long, device=device)

    def update(self, sl: slice, z: torch.Tensor, slope: torch.Tensor | None, targets: torch.Tensor, start: int,
               rows: torch.Tensor, acc: torch.Tensor | None, w_target: torch.Tensor | None) -> None:
        """Fold the logits ``z`` (chunk, block rows) of tokens ``sl`` into the state; with ``acc`` also
        Σ exp(z − max)·slope·W (rescaled as the max moves) and the target's row W[target]·slope."""
        local = targets - start
        inside = (local >= 0) & (local < rows.size(0))
        idx = local.clamp(0, rows.size(0) - 1)
        self.picked[sl] = torch.where(inside, z.gather(1, idx[:, None]).squeeze(1), self.picked[sl])
        top, top_i = z.max(dim=1)
        better = top > self.best[sl]
        self.best[sl] = torch.where(better, top, self.best[sl])
        self.arg[sl] = torch.where(better, top_i + start, self.arg[sl])
        new_m = torch.maximum(self.m[sl], top)
        rescale = torch.exp(self.m[sl] - new_m)
        e = z.sub_(new_m[:, None]).exp_()  # z is spent: exp(z - max) in place
        self.s[sl] = self.s[sl] * rescale + e.sum(dim=1)
        self.m[sl] = new_m
        if acc is None:
            return
        target_row = rows[idx]
        if slope is not None:
            e.mul_(slope)
            target_row = target_row * slope.gather(1, idx[:, None]).to(rows.dtype)
        w_target += torch.where(inside[:, None], target_row, 0)
        acc.mul_(rescale[:, None]).add_((e.to(rows.dtype) @ rows).float())

    def derivative(self, sl: slice, acc: torch.Tensor, w_target: torch.Tensor | None, valid: torch.Tensor,
                   t: Transform, dtype: torch.dtype, norm: torch.Tensor | None = None) -> torch.Tensor:
        """d log p(target) / d hidden = scale·(W[target]·slope − Σ_v softmax_v·slope_v·W_v); 0 without a target.
        ``norm``: what divides ``acc`` into softmax shares, per token (default: this state's sum of exp, when
        the whole vocabulary passed here); ``w_target`` None: no target row passed here."""
        d = acc.div_((self.s[sl] if norm is None else norm)[:, None]).neg_()  # acc is spent: in place
        if w_target is not None:
            d.add_(w_target)
        d.mul_(valid[:, None])
        return (d.mul_(t.scale) if t.scale != 1.0 else d).to(dtype)


def _logits(hidden: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None, start: int,
            t: Transform) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's logits for one block of the vocabulary, in fp32, as the model transforms them."""
    b = bias[start:start + rows.size(0)] if bias is not None else None
    return _apply(F.linear(hidden.to(rows.dtype), rows, b).float(), t)


class TargetLogProbs(torch.autograd.Function):
    """hidden (..., H), targets (...) → log p(target) (...) fp32 and argmax == target (...), chunked."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, blocks, bias, t: Transform,  # type: ignore[override]
                chunk: int, single: bool) -> tuple[torch.Tensor, torch.Tensor]:
        flat, tgt = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        n, width, device = flat.size(0), flat.size(-1), flat.device
        grad = ctx.needs_input_grad[0]
        state = _Running(n, device)
        valid = tgt != IGNORE
        deriv = torch.empty_like(flat) if grad else None
        chunks = [slice(a, min(n, a + chunk)) for a in range(0, n, chunk)]
        if single:  # one block: each chunk is final at once, its temporaries are the chunk's only
            ((start, rows),) = list(blocks())
            for sl in chunks:
                size = sl.stop - sl.start
                acc = torch.zeros(size, width, device=device) if grad else None
                w_target = torch.zeros(size, width, dtype=rows.dtype, device=device) if grad else None
                z, slope = _logits(flat[sl], rows, bias, start, t)
                state.update(sl, z, slope, tgt[sl], start, rows, acc, w_target)
                if grad:
                    deriv[sl] = state.derivative(sl, acc, w_target, valid[sl], t, flat.dtype)
                del z, slope, acc, w_target
        else:  # a block per rank's rows: the running state of every token, one broadcast per block
            acc, w_target = _stream(state, flat, tgt, blocks(), bias, t, chunk, grad)
            if grad:
                deriv = state.derivative(slice(0, n), acc, w_target, valid, t, flat.dtype)
                del acc, w_target
        logps = torch.where(valid, state.picked - (state.m + state.s.log()), 0.0)
        return _results(ctx, hidden, targets, chunk, logps, valid & (state.arg == tgt), deriv)

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor, _grad_correct):  # type: ignore[override]
        return _times_upstream(ctx, grad_logps), None, None, None, None, None, None


def _results(ctx, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, logps: torch.Tensor,
             correct: torch.Tensor, deriv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's outputs shaped as the targets, with what its backward needs kept (``deriv``: with a gradient)."""
    if deriv is not None:
        ctx.save_for_backward(deriv)
    ctx.shape, ctx.chunk = hidden.shape, chunk
    ctx.mark_non_differentiable(correct)
    return logps.view(targets.shape), correct.view(targets.shape)


def _times_upstream(ctx, grad_logps: torch.Tensor) -> torch.Tensor:
    """The hidden states' gradient: the derivative saved in forward times the incoming gradient."""
    (deriv,) = ctx.saved_tensors
    g = grad_logps.reshape(-1, 1).float()
    grad = torch.empty_like(deriv)
    for a in range(0, deriv.size(0), ctx.chunk):  # fp32 products a chunk at a time: no fp32 copy of it all
        grad[a:a + ctx.chunk] = deriv[a:a + ctx.chunk].float() * g[a:a + ctx.chunk]
    return grad.view(ctx.shape)


def _stream(state: _Running, flat: torch.Tensor, tgt: torch.Tensor, blocks: Iterator[tuple[int, torch.Tensor]],
            bias: torch.Tensor | None, t: Transform, chunk: int,
            grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Fold every block of the vocabulary into ``state``, for all tokens of ``flat``, a chunk at a time;
    with ``grad`` returns the derivative's accumulators (``_Running.update``'s ``acc`` and ``w_target``, the
    latter None when no block came)."""
    n, width, device = flat.size(0), flat.size(-1), flat.device
    acc = torch.zeros(n, width, device=device) if grad else None
    w_target = None
    for start, rows in blocks:
        if grad and w_target is None:
            w_target = torch.zeros(n, width, dtype=rows.dtype, device=device)
        for a in range(0, n, chunk):
            sl = slice(a, min(n, a + chunk))
            z, slope = _logits(flat[sl], rows, bias, start, t)
            state.update(sl, z, slope, tgt[sl], start, rows, acc[sl] if grad else None,
                         w_target[sl] if grad else None)
            del z, slope
    return acc, w_target


# --- FSDP2's row-sharded head used vocabulary-parallel, where that moves fewer bytes than its rows -----------

def scoring_cost(width: int, itemsize: int, ranks: int, grad: bool) -> sharded.ExchangeCost:
    """What scoring by exchange costs per token (``sharded_embeddings.ExchangeCost``), on ``ranks`` ranks, for
    hidden states of ``width`` and a table of ``itemsize`` bytes: moved, the hidden state and the target
    gathered, each rank's 4 statistics of it gathered and, with a gradient, its fp32 derivative sent back; held
    per gathered token, its hidden state, the running sums in fp32 and the table's dtype, the derivative's
    shares received. The runtime (``exchange_size``) and the planner (train/memory_model.py) both use it."""
    moved = width * itemsize + 8 + 16 * ranks + (4 * width if grad else 0)
    return sharded.ExchangeCost(moved, width * (2 * itemsize + 8))


def exchange_size(head: nn.Module, hidden: torch.Tensor) -> int | None:
    """The tokens every rank pads to when ``head`` is row-sharded and scoring by exchange is the cheaper way
    (sharded_embeddings.exchange_size, a collective); None otherwise.

    Costed as a pass with a gradient, as the planner costs it, whether or not this one has one: every pass that
    scores the same tokens (the policy, the reference, GRPO's old policy) then takes the same path, so their
    log-probabilities agree to the bit where their weights do (DPO's rewards are exactly 0 at the first step,
    GRPO's first ratio exactly 1), on any number of ranks as on one."""
    if not isinstance(head, ShardedHead):
        return None
    width = hidden.size(-1)
    cost = scoring_cost(width, head.weight.to_local().element_size(), head.group.size(), grad=True)
    return sharded.exchange_size(head, hidden.numel() // width, cost, kind="scored")


class ExchangedTargetLogProbs(torch.autograd.Function):
    """``TargetLogProbs`` on a row-sharded head without moving its rows: every rank's tokens (padded to
    ``size``) scored on every rank's rows, a piece at a time (``_exchanged_piece``). A collective."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, head: ShardedHead,  # type: ignore[override]
                t: Transform, chunk: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat, tgt = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        n, grad, local = flat.size(0), ctx.needs_input_grad[0], head.weight.to_local()
        logps = torch.zeros(n, device=flat.device)
        correct = torch.zeros(n, dtype=torch.bool, device=flat.device)
        deriv = torch.empty_like(flat) if grad else None
        piece = sharded.exchange_piece(head, scoring_cost(flat.size(-1), local.element_size(), head.group.size(), grad))
        for a in range(0, size, piece):
            b = min(size, a + piece)
            here = slice(a, max(a, min(b, n)))
            # chunks of at most a rank's tokens: the logits the broadcast path would hold for the largest rank
            logps[here], correct[here], d = _exchanged_piece(flat[here], tgt[here], head, t, min(chunk, b - a),
                                                             b - a, grad)
            if grad:
                deriv[here] = d
        return _results(ctx, hidden, targets, chunk, logps, correct, deriv)

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor, _grad_correct):  # type: ignore[override]
        return _times_upstream(ctx, grad_logps), None, None, None, None, None


def _exchanged_piece(flat: torch.Tensor, tgt: torch.Tensor, head: ShardedHead, t: Transform, chunk: int,
                     size: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log p(target), argmax == target and (with ``grad``) the derivative of this rank's ``flat``: every rank's
    tokens (padded to ``size``) are gathered and streamed over the rows here; every rank's statistics of every
    token (max, sum of exp, target logit, best token) are gathered and merged as the blocks' running state
    merges them; each rank's share of every token's derivative is summed at the token's owner."""
    n, group, local = flat.size(0), head.group, head.weight.to_local()
    ranks, mine = group.size(), slice(group.rank() * size, group.rank() * size + n)
    everyone = sharded.gather_tokens(flat.to(local.dtype), size, 0.0, group).view(ranks * size, -1)
    every_tgt = sharded.gather_tokens(tgt, size, IGNORE, group).view(-1)
    state = _Running(ranks * size, flat.device)
    blocks = iter([(sharded.first_row(head), local)] if local.size(0) else [])
    acc, w_target = _stream(state, everyone, every_tgt, blocks, None, t, chunk, grad)
    del everyone
    # every rank's statistics, (ranks, every token); the best token's index exact in fp32 below 2^24 rows
    stats = torch.stack([state.m, state.s, state.picked, state.arg.float()], dim=1)
    m, s, picked, arg = sharded.gather_tokens(stats, ranks * size, 0.0, group).unbind(-1)
    top = m.max(dim=0).values
    total = (s * (m - top).exp()).sum(0)  # a rank without rows: max -inf, its share 0
    valid = tgt != IGNORE
    logps = torch.where(valid, picked.sum(0)[mine] - (top[mine] + total[mine].log()), 0.0)
    first_best = (m == top).float().argmax(dim=0)  # ties: the lowest rank's, as the blocks' order gives
    correct = valid & (arg.gather(0, first_best[None])[0, mine].long() == tgt)
    if not grad:
        return logps, correct, None
    # each rank's share of every token's derivative: its sums are relative to its own max, not the global one
    share = state.derivative(slice(None), acc, w_target, every_tgt != IGNORE, t, torch.float32,
                             norm=total / (state.m - top).exp())
    del acc, w_target
    return logps, correct, sharded.to_owners(share.view(ranks, size, -1), group).sum(0)[:n].to(flat.dtype)
