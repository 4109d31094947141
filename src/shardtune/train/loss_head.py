"""The loss head: each target token's log-probability, computed without ever holding the full logits.

A causal LM's output projection makes tokens × vocabulary logits (49,152 per token for SmolLM2, 128k for
Llama 3): at long context they and their gradient are most of a step's memory (~390 KB a token in fp32
for SmolLM2's vocabulary). Every objective needs only log p(target) per position (SFT sums them; DPO,
ORPO and SimPO sum them per sequence; GRPO takes them per token), so the head computes exactly that,
a chunk of tokens at a time:

* forward, per chunk: the chunk's logits (in the compute dtype, as the model's own head), in fp32 the
  log-sum-exp, the target's logit and whether it is the most likely token; and, when a gradient will be
  needed, the derivative of log p(target) with respect to the chunk's hidden states,
  ``W[target] − softmax · W`` (with Gemma's softcapping its chain rule), written in the compute dtype;
* backward: that derivative times the incoming gradient. No logits are recomputed or kept: the head
  costs the same two matmuls as an ordinary head and its backward, and holds one chunk of logits.

The vocabulary comes in blocks: the whole weight of an ``nn.Linear`` head (FSDP1's root unit, DDP,
single, FSDP2's gathered head), or each rank's rows of FSDP2's row-sharded head in turn
(parallel/sharded_embeddings.py: one broadcast per block, once per forward, none in backward), merged
by a running log-sum-exp.

The head is the model's own output-embedding module, taught to score (``install``): called inside the
model's forward, so every FSDP hook around it runs as for the logits. ``score`` sets the targets for one
forward; the model then returns the log-probabilities where it returned logits. Transformations
models apply to logits after the head (Gemma's final softcapping, Granite's and Cohere's scaling) are
done by the head instead while it scores. A head it cannot score this way (trainable, a LoRA layer, a
model with another transformation after its head) is run whole and its logits go through a chunked
cross-entropy (``loss.py``), as before: correct, at the old memory cost; ``install`` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.model.head import Transform, head_transform
from shardtune.model.structure import base_model
from shardtune.parallel.sharded_embeddings import ShardedHead
from shardtune.train.data.records import IGNORE
from shardtune.train.loss import token_cross_entropy

log = logging.getLogger("shardtune")

#: fp32 bytes of one chunk of logits: large enough for efficient matmuls on a GPU, small next to a model
CHUNK_BYTES = 64 * 1024 * 1024


def chunk_tokens(vocab: int, override: int | None = None) -> int:
    """Tokens per chunk: ``override`` (--loss-chunk), else as many as fit CHUNK_BYTES of fp32 logits."""
    return override or max(1, CHUNK_BYTES // (4 * vocab))


@dataclass
class Scores:
    """What one forward scored, per position (rows, width)."""

    logps: torch.Tensor  # fp32 log p(target), 0 where there is no target; differentiable
    correct: torch.Tensor  # bool: the target is the most likely token (False where there is no target)


class _Head:
    """The state ``install`` keeps on the head module."""

    def __init__(self, module: nn.Module, transform: Transform, chunk: int | None) -> None:
        self.module, self.transform, self.chunk = module, transform, chunk
        self.original = module.forward
        self.targets: torch.Tensor | None = None
        self.correct: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:  # generation, or any caller that wants logits
            return self.original(hidden)
        blocks, weight, bias = _blocks_of(self.module)
        vocab = weight.size(0) if weight is not None else self.module.out_features
        logps, correct = _TargetLogProbs.apply(hidden, self.targets, blocks, bias, self.transform,
                                               chunk_tokens(vocab, self.chunk), weight is not None)
        self.correct = correct
        return logps


def _blocks_of(head: nn.Module) -> tuple[Callable[[], Iterator[tuple[int, torch.Tensor]]], torch.Tensor | None,
                                          torch.Tensor | None]:
    """(a function giving the vocabulary's (first row, weight rows) blocks, the whole weight or None, the bias)."""
    if isinstance(head, ShardedHead):
        return head.blocks, None, None
    weight = head.weight
    return (lambda: iter([(0, weight)])), weight, head.bias


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

    def derivative(self, sl: slice, acc: torch.Tensor, w_target: torch.Tensor, valid: torch.Tensor,
                   t: Transform, dtype: torch.dtype) -> torch.Tensor:
        """d log p(target) / d hidden = scale·(W[target]·slope − Σ_v softmax_v·slope_v·W_v); 0 without a target."""
        d = (w_target.float() - acc / self.s[sl, None]).mul_(valid[:, None])
        return (d.mul_(t.scale) if t.scale != 1.0 else d).to(dtype)


def _logits(hidden: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None, start: int,
            t: Transform) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's logits for one block of the vocabulary, in fp32, as the model transforms them."""
    b = bias[start:start + rows.size(0)] if bias is not None else None
    return _apply(F.linear(hidden.to(rows.dtype), rows, b).float(), t)


class _TargetLogProbs(torch.autograd.Function):
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
            acc = torch.zeros(n, width, device=device) if grad else None
            w_target = None
            for start, rows in blocks():
                if grad and w_target is None:
                    w_target = torch.zeros(n, width, dtype=rows.dtype, device=device)
                for sl in chunks:
                    z, slope = _logits(flat[sl], rows, bias, start, t)
                    state.update(sl, z, slope, tgt[sl], start, rows, acc[sl] if grad else None,
                                 w_target[sl] if grad else None)
                    del z, slope
            if grad:
                deriv = state.derivative(slice(0, n), acc, w_target, valid, t, flat.dtype)
                del acc, w_target
        logps = torch.where(valid, state.picked - (state.m + state.s.log()), 0.0)
        correct = valid & (state.arg == tgt)
        if grad:
            ctx.save_for_backward(deriv)
        ctx.shape, ctx.chunk = hidden.shape, chunk
        ctx.mark_non_differentiable(correct)
        return logps.view(targets.shape), correct.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor, _grad_correct):  # type: ignore[override]
        (deriv,) = ctx.saved_tensors
        g = grad_logps.reshape(-1, 1).float()
        grad = torch.empty_like(deriv)
        for a in range(0, deriv.size(0), ctx.chunk):  # fp32 products a chunk at a time: no fp32 copy of it all
            grad[a:a + ctx.chunk] = deriv[a:a + ctx.chunk].float() * g[a:a + ctx.chunk]
        return grad.view(ctx.shape), None, None, None, None, None, None


# --- installing the scoring head on a model ---------------------------------------------------------------

def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP's and peft's wrappers (FSDP1's forwards every attribute)."""
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return base_model(model)


def _output_embedding(model: nn.Module) -> nn.Module | None:
    """The model's output-embedding module (inside FSDP1's wrapper, when it has one)."""
    found = _unwrapped(model).get_output_embeddings()
    return _innermost(found) if isinstance(found, nn.Module) else None


def _innermost(module: nn.Module) -> nn.Module:
    """The head itself inside an FSDP1 wrapper (whose forward gathers and then calls it)."""
    return getattr(module, "_fsdp_wrapped_module", module)


def install(model: nn.Module, chunk: int | None = None) -> bool:
    """Teach ``model``'s output embedding to score targets (idempotent); False when it cannot, and the
    full logits are computed instead (said once in the log)."""
    head = _output_embedding(model)
    if head is None:
        return False
    if isinstance(getattr(head, "_shardtune_head", None), _Head):
        head._shardtune_head.chunk = chunk
        return True
    transform, reason = head_transform(_unwrapped(model), head)
    if transform is None:
        log.info("loss head: %s, so the full logits are computed", reason)
        return False
    state = _Head(head, transform, chunk)
    head._shardtune_head = state
    head.forward = state.forward
    return True


def _head_state(model: nn.Module) -> _Head | None:
    head = _output_embedding(model)
    state = getattr(head, "_shardtune_head", None)
    return state if isinstance(state, _Head) else None


@contextlib.contextmanager
def _scoring(state: _Head, targets: torch.Tensor) -> Iterator[None]:
    saved = [(cfg, attr, getattr(cfg, attr)) for cfg, attr, _ in state.transform.neutral]
    state.targets = targets
    for cfg, attr, value in state.transform.neutral:
        setattr(cfg, attr, value)
    try:
        yield
    finally:
        state.targets = None
        for cfg, attr, value in saved:
            setattr(cfg, attr, value)


def score(model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
          temperature: float = 1.0) -> Scores:
    """One forward of ``model`` on ``inputs``, scored against ``targets`` (rows, width): the token each
    position predicts, IGNORE where none (see ``Scores``). ``temperature``: the log-probabilities of
    logits / temperature (GRPO scores completions as they were sampled); the head scales its logits, or,
    after a softcap (which comes first), the full logits are divided."""
    state = _head_state(model)
    if state is None or (temperature != 1.0 and state.transform.softcap is not None):
        logits = model(**inputs).logits
        if temperature != 1.0:
            logits = logits.float() / temperature
        logps = -token_cross_entropy(logits, targets)
        with torch.no_grad():
            correct = (logits.argmax(dim=-1) == targets) & (targets != IGNORE)
        return Scores(logps, correct)
    transform = state.transform
    if temperature != 1.0:
        state.transform = dataclasses.replace(transform, scale=transform.scale / temperature)
    try:
        with _scoring(state, targets):
            logps = model(**inputs).logits
    finally:
        state.transform = transform
    correct, state.correct = state.correct, None
    return Scores(logps, correct)
