"""The loss head: each target token's log-probability, computed without ever holding the full logits.

A causal LM's output projection makes tokens × vocabulary logits (49,152 per token for SmolLM2, 128k for
Llama 3): at long context they and their gradient are most of a step's memory (~390 KB a token in fp32
for SmolLM2's vocabulary). Every objective needs only log p(target) per position (SFT sums them; DPO,
ORPO and SimPO sum them per sequence; GRPO takes them per token), so the head computes exactly that,
a chunk of tokens at a time and a block of the vocabulary at a time (target_logprobs.py, which also scores
FSDP2's row-sharded head by exchanging the tokens where that moves fewer bytes than its rows).

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
from torch import nn

from shardtune.model.head import Transform, head_transform
from shardtune.model.structure import base_model
from shardtune.parallel import agreed_counts
from shardtune.parallel.sharded_embeddings import ShardedHead
from shardtune.train.data.records import IGNORE
from shardtune.train.loss import token_cross_entropy
from shardtune.train.target_logprobs import ExchangedTargetLogProbs, TargetLogProbs, exchange_size

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
        self.scored: torch.Tensor | None = None  # the flat positions of targets that have one (None: all)
        self.correct: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:  # generation, or any caller that wants logits
            return self.original(hidden)
        targets, kept = self.targets, self.scored
        if kept is not None:  # only positions with a target are scored (``score``)
            hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, kept)
            targets = targets.reshape(-1).index_select(0, kept)
        blocks, weight, bias = _blocks_of(self.module)
        vocab = weight.size(0) if weight is not None else self.module.out_features
        chunk = chunk_tokens(vocab, self.chunk)
        size = exchange_size(self.module, hidden)
        if size is not None:
            logps, correct = ExchangedTargetLogProbs.apply(hidden, targets, self.module, self.transform, chunk, size)
        else:
            logps, correct = TargetLogProbs.apply(hidden, targets, blocks, bias, self.transform, chunk,
                                                  weight is not None)
        if kept is not None:  # 0 and False where there is no target, as the head gives there
            n = self.targets.numel()
            logps = logps.new_zeros(n).index_copy(0, kept, logps).view(self.targets.shape)
            correct = correct.new_zeros(n).index_copy(0, kept, correct).view(self.targets.shape)
        self.correct = correct
        return logps


def _blocks_of(head: nn.Module) -> tuple[Callable[[], Iterator[tuple[int, torch.Tensor]]], torch.Tensor | None,
                                          torch.Tensor | None]:
    """(a function giving the vocabulary's (first row, weight rows) blocks, the whole weight or None, the bias)."""
    if isinstance(head, ShardedHead):
        return head.blocks, None, None
    weight = head.weight
    return (lambda: iter([(0, weight)])), weight, head.bias


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
def _scoring(state: _Head, targets: torch.Tensor, scored: torch.Tensor | None) -> Iterator[None]:
    saved = [(cfg, attr, getattr(cfg, attr)) for cfg, attr, _ in state.transform.neutral]
    state.targets, state.scored = targets, scored
    for cfg, attr, value in state.transform.neutral:
        setattr(cfg, attr, value)
    try:
        yield
    finally:
        state.targets = state.scored = None
        for cfg, attr, value in saved:
            setattr(cfg, attr, value)


def score(model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
          temperature: float = 1.0, scored: torch.Tensor | None = None) -> Scores:
    """One forward of ``model`` on ``inputs``, scored against ``targets`` (rows, width): the token each
    position predicts, IGNORE where none (see ``Scores``). ``scored``: the flat positions that have a target
    (data/batch.py ``Forward.scored``), the only ones the head then scores, as TRL's ``logits_to_keep`` leaves
    out the prompt: a position without one (a prompt's token, padding) would cost the head's two matmuls over
    the vocabulary for a log-probability nobody reads, and the head is a large share of a small model's step
    (SmolLM2's 49,152 rows). None: every position. ``temperature``: the log-probabilities of
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
    # both counts the forward's parts pad to are known here, before it starts: agreed on once (agreed_counts.py)
    counted = agreed_counts.forward(targets.numel(), targets.numel() if scored is None else scored.numel())
    try:
        with _scoring(state, targets, scored), counted:
            logps = model(**inputs).logits
    finally:
        state.transform = transform
    correct, state.correct = state.correct, None
    return Scores(logps, correct)
