"""Cross-entropy of full logits whose fp32 working memory does not grow with tokens × vocabulary.

The fallback of the loss head (loss_head.py) for a head it cannot score chunk by chunk (a trained or
LoRA-adapted output projection): the model's logits exist, and only the fp32 work is chunked.
``F.cross_entropy(logits.float(), …)`` keeps, per token and vocabulary entry, the fp32 copy's
log-softmax for backward and then allocates fp32 gradients of the same size: about 14 bytes per
logit at its peak in backward, on top of the model's logits. Here the fp32 work happens a few hundred
tokens at a time: forward keeps one log-sum-exp per token, backward recomputes each chunk's softmax
from the (already resident) logits and writes the gradient straight into one tensor in the logits'
dtype. Peak: the logits' own gradient plus one fp32 chunk. The values are those of
``F.cross_entropy(..., reduction="none")`` in fp32, up to summation order.
"""

from __future__ import annotations

import torch

from shardtune.train.data.records import IGNORE

#: fp32 bytes of one chunk of logits: big enough that the loop costs nothing next to the model.
CHUNK_BYTES = 32 * 1024 * 1024


def chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _ChunkedTokenCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy, (batch, time) in fp32, 0 where the target is IGNORE."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        flat, tgt = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        step = chunk_tokens(flat.size(-1))
        lse = torch.empty(flat.size(0), dtype=torch.float32, device=flat.device)
        losses = torch.empty(flat.size(0), dtype=torch.float32, device=flat.device)
        for start in range(0, flat.size(0), step):
            x = flat[start:start + step].float()
            t = tgt[start:start + step]
            lse[start:start + step] = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            losses[start:start + step] = torch.where(t != IGNORE, lse[start:start + step] - picked, 0.0)
        ctx.save_for_backward(logits, targets, lse)
        return losses.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        flat, tgt, g = logits.reshape(-1, logits.size(-1)), targets.reshape(-1), grad_losses.reshape(-1)
        step = chunk_tokens(flat.size(-1))
        grad = torch.empty_like(flat)
        for start in range(0, flat.size(0), step):
            end = start + step
            t = tgt[start:end]
            p = flat[start:end].float().sub_(lse[start:end, None]).exp_()  # softmax
            p.scatter_add_(1, t.clamp(min=0).unsqueeze(1), torch.full_like(p[:, :1], -1.0))
            weight = (t != IGNORE).to(p.dtype) * g[start:end].float()
            grad[start:end] = p.mul_(weight.unsqueeze(1))  # cast to the logits' dtype here
        return grad.view_as(logits), None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(targets[t]) at each position t from ``logits`` (..., vocab), in fp32, 0 where the target is
    IGNORE; ``targets`` already name the token each position predicts."""
    return _ChunkedTokenCrossEntropy.apply(logits, targets)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position: the next token's label (IGNORE at each row's end)."""
    targets = torch.full_like(labels, IGNORE)
    targets[..., :-1] = labels[..., 1:]
    return targets
