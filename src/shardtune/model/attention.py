"""Attention whose memory grows with the sequence, never with its square: packed records, padded batches.

The transformers ``sdpa`` and ``eager`` paths take a dense mask for anything but a plain causal
sequence: a packed row of several records gets a 4-D block-diagonal mask of rows × width² elements
(4 GB at 32k tokens in fp32), and with any mask SDPA leaves its flash kernel for the math path, which
keeps the width² scores too. Neither is needed:

* a **packed** forward is one row of records laid end to end (the layout of flash's variable-length
  attention); here each record runs its own causal SDPA, on its own slice of the row, so no token sees
  another record and no mask exists (``shardtune_lengths``: the records' lengths, host integers, so
  that no device value is read per layer);
* a **padded** micro-batch is right-padded: with causal attention a real token never sees the padding
  after it, so it needs no mask either (the padding's own outputs are never scored).

Both run SDPA with ``is_causal``, whose flash kernels (CPU and CUDA) keep O(s) memory. Sliding-window
layers (Mistral, Qwen2, Gemma 3's local layers) attend in blocks of the window: each block of queries
sees the keys of its window, a mask of window × 2·window, never s².

The implementation is registered with transformers as ``shardtune`` and switched on by
``use_shardtune_attention`` for models whose attention goes through transformers' attention
interface (``_supports_attention_backend``); others keep their own attention and the dense masks
(data/pack.py). Flash-attention (GPU, when installed) keeps its own variable-length kernels.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

NAME = "shardtune"
#: attention implementations given packed records as one row with their lengths (no mask)
VARLEN = ("flash_attention_2", "flash_attention_3", NAME)
#: implementations that need a dense mask to keep packed records apart (and a 2-D mask for padding)
MASKED = ("sdpa", "eager")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dropout: float,
          window: int | None) -> torch.Tensor:
    """Causal attention of one sequence (batch, heads, s, dim); keys/values may have fewer heads (GQA)."""
    gqa = q.size(1) != k.size(1)
    s = q.size(2)
    if window is None or window >= s:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=s > 1, scale=scale,
                                              enable_gqa=gqa)
    out = []
    for a in range(0, s, window):  # queries [a, b) see keys (i - window, i]: the keys [a - window + 1, b)
        b = min(s, a + window)
        k0 = max(0, a - window + 1)
        i = torch.arange(a, b, device=q.device)[:, None]
        j = torch.arange(k0, b, device=q.device)[None, :]
        mask = (j <= i) & (i - j < window)
        out.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, k0:b], v[:, :, k0:b], attn_mask=mask,
                                                  dropout_p=dropout, scale=scale, enable_gqa=gqa))
    return torch.cat(out, dim=2)


def record_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[Sequence[int]],
                     scale: float | None = None, dropout: float = 0.0, window: int | None = None) -> torch.Tensor:
    """Causal attention of each segment of each row on its own: ``(rows, heads, seq, dim)`` in and out,
    ``bounds[row]`` the cuts between the row's segments (0, ..., seq): a packed record, or a whole row.
    No token sees another segment and no mask is built. The one rule for keeping records apart, used
    with and without context parallelism (parallel/ulysses.py runs it on a rank's share of the heads)."""
    if all(len(cuts) == 2 for cuts in bounds):  # a segment per row: one call for the whole batch
        return _sdpa(q, k, v, scale, dropout, window)
    rows = []
    # Cut with split, not slicing: split's backward is one concatenation, a slice's a zero tensor of the
    # whole input per record.
    for cuts, qr, kr, vr in zip(bounds, q.split(1), k.split(1), v.split(1)):
        lengths = [b - a for a, b in zip(cuts, cuts[1:])]
        parts = [_sdpa(qs, ks, vs, scale, dropout, window)
                 for qs, ks, vs in zip(qr.split(lengths, 2), kr.split(lengths, 2), vr.split(lengths, 2))]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


#: ``shardtune_cp(q, k, v, scale, attend)``: attention of this rank's piece of every row across the pieces
#: of its context-parallel group (parallel/ulysses.py's ``PieceAttention``), ``attend`` the per-record rule
PieceAttention = Callable[..., torch.Tensor]


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, shardtune_lengths: tuple[int, ...] | None = None,
              shardtune_cp: PieceAttention | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: (batch, heads, s, dim) in, (batch, s, heads, dim) out.
    ``shardtune_lengths``: one packed row's records; ``shardtune_cp``: the rows are this rank's pieces
    (context parallelism; every rank of the group calls it, whatever its piece holds)."""
    dropout = dropout if module.training else 0.0
    if shardtune_cp is not None:
        attend = functools.partial(record_attention, dropout=dropout, window=sliding_window)
        return shardtune_cp(query, key, value, scaling, attend).transpose(1, 2).contiguous(), None
    q_len, k_len = query.size(2), key.size(2)
    if attention_mask is not None or (q_len != k_len and q_len != 1):
        # Not a training forward (a cache with a mask, chunked prefill): transformers' own SDPA path.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if q_len == 1:  # one new token against the cache: it sees every key
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=query.size(1) != key.size(1))
    elif shardtune_lengths is None:
        out = _sdpa(query, key, value, scaling, dropout, sliding_window)
    else:
        if query.size(0) != 1 or sum(shardtune_lengths) != q_len:
            raise ValueError(f"packed attention: lengths {sum(shardtune_lengths)} tokens in all for a batch of "
                             f"{tuple(query.shape[:1])} rows of {q_len}")
        cuts = [0, *itertools.accumulate(shardtune_lengths)]
        out = record_attention(query, key, value, [cuts], scaling, dropout, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``shardtune`` an attention implementation transformers knows (idempotent). Without a mask
    function of its own, transformers builds no mask for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)


def implementation(model: nn.Module) -> str:
    """The attention implementation the (peft, FSDP or DDP wrapped) transformers model runs."""
    return getattr(_config(model), "_attn_implementation", None) or "eager"


def _config(model: nn.Module):
    return next(m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "model_type"))


def _transformers_model(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if hasattr(m, "set_attn_implementation"))


def use_shardtune_attention(model: nn.Module) -> str:
    """Switch a model that runs ``sdpa`` through transformers' attention interface to ``shardtune``;
    return the implementation it runs now. ``eager`` models (Gemma 2's attention softcapping needs
    it), flash-attention and models with attention code of their own keep theirs."""
    inner = _transformers_model(model)
    if implementation(model) == "sdpa" and getattr(inner, "_supports_attention_backend", False):
        register()
        inner.set_attn_implementation(NAME)
    return implementation(model)


@contextlib.contextmanager
def shardtune_attention(model: nn.Module) -> Iterator[str]:
    """``use_shardtune_attention`` for the forwards inside, the model's own implementation after (for a
    model that also generates: ``shardtune`` builds no padding mask, which left-padded prompts need)."""
    before = implementation(model)
    now = use_shardtune_attention(model)
    try:
        yield now
    finally:
        if now != before:
            _transformers_model(model).set_attn_implementation(before)


def check_context_parallel(model: nn.Module, size: int) -> None:
    """Refuse ``--context-parallel size`` (before loading) where ``context_parallel_refusal`` says why."""
    from shardtune.config import ConfigError

    refused = context_parallel_refusal(model, size)
    if refused:
        raise ConfigError(refused)


def context_parallel_refusal(model: nn.Module, size: int) -> str | None:
    """Why ``--context-parallel size`` cannot split ``model``'s attention (None: it can): its attention
    does not go through transformers' attention interface as SDPA (which becomes ``shardtune``, where
    the pieces meet), or it has fewer query heads than ranks (each rank attends for a share of them)."""
    if size == 1:
        return None
    config = _config(model)
    impl = implementation(model)
    own = not getattr(_transformers_model(model), "_supports_attention_backend", False)
    if impl not in ("sdpa", NAME) or own:
        what = "attention code of its own" if own else f"attention '{impl}'"
        return (f"option 'context-parallel' ({size}): the model ({config.model_type}) runs {what}, which context "
                "parallelism cannot split: it needs sdpa through transformers' attention interface (Llama, "
                "Qwen2/3, Mistral, Gemma 3, ...); train this model without --context-parallel")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if heads is not None and size > heads:
        return (f"option 'context-parallel' ({size}): the model ({config.model_type}) has {heads} attention "
                f"heads, and each rank of a group attends for a share of them: use at most {heads}")
    return None


@contextlib.contextmanager
def sdpa_attention(model: nn.Module) -> Iterator[str]:
    """The model on transformers' ``sdpa`` for the forwards inside (generation: left-padded prompts and a KV
    cache need the padding mask that ``shardtune`` never builds), back on its own implementation after."""
    before = implementation(model)
    if before == NAME:
        _transformers_model(model).set_attn_implementation("sdpa")
    try:
        yield implementation(model)
    finally:
        if before == NAME:
            _transformers_model(model).set_attn_implementation(before)
