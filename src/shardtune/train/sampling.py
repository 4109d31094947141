"""Sampling completions token by token with a KV cache, seeded so that they do not depend on the split.

Each completion has its own random stream, a ``torch.Generator`` seeded from (seed, step, prompt index,
completion index): which rank samples it, next to which other prompts, in which batch, changes nothing but
the rounding of the logits (batch shapes pick different kernels); at a token whose two candidates the
rounding separates, a split can still tell. A token is drawn by inverse CDF from one uniform number per step
of that stream, so CPU and GPU read the same draws.

The loop runs over any ``next_logits(ids, attention_mask, position_ids, cache) -> (rows, vocab)`` (the
last position's logits): ``hf_next_logits(model)`` for a Hugging Face model (peft, FSDP-wrapped or not), or
a sharded model's own. Prompts are left-padded, positions count real tokens only (as ``generate`` does), a
completion ends at its first EOS (kept, as TRL keeps it) and one that reaches ``max_new_tokens`` without
one is flagged ``truncated``. Under FSDP every forward is a collective: ``keep_going`` (an all-reduce of
"this rank still has unfinished rows") keeps the ranks stepping together until every rank is done.

Warping as ``generate``: logits / temperature, then top-k (ties at the k-th kept), then top-p (the smallest
set of most likely tokens whose probability exceeds top_p; at least one). temperature 0: greedy.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.config import ConfigError

#: (ids (rows, t), attention_mask (rows, past + t), position_ids (rows, t), cache) -> (rows, vocab) last logits
NextLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_completion_length must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not self.eos_ids:
            raise ConfigError("sampling needs at least one EOS token id to stop at")


@dataclass
class Completion:
    ids: list[int]  # the sampled tokens, the EOS included when the completion ended with one
    truncated: bool  # cut by max_new_tokens
    logps: list[float | None] | None = None  # a vLLM sampler's log-prob of each token (None: one it did not score)


def completion_seed(seed: int, step: int, prompt_index: int, completion_index: int) -> int:
    """A 63-bit seed of its own for each completion, the same on every machine and Python."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, step, prompt_index, completion_index), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def completion_generator(seed: int, step: int, prompt_index: int, completion_index: int) -> torch.Generator:
    return torch.Generator().manual_seed(completion_seed(seed, step, prompt_index, completion_index))


def warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """fp32 logits / temperature, −inf outside the top-k and the top-p nucleus (``generate``'s warpers)."""
    scores = logits.float()
    if temperature != 1.0:  # x / 1 is x: a vocabulary-sized tensor a token fewer at the usual temperature
        scores = scores / temperature
    if 0 < top_k < scores.size(-1):
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return scores


def pick(logits: torch.Tensor, settings: SamplingSettings, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else drawn with the row's own generator."""
    if settings.temperature == 0:
        return logits.argmax(-1)
    # converted inside softmax and summed in place: one vocabulary-sized fp64 tensor a token, not three
    cdf = warp(logits, settings.temperature, settings.top_k, settings.top_p).softmax(-1, dtype=torch.float64)
    cdf.cumsum_(-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(cdf.device)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return tokens.clamp(max=logits.size(-1) - 1)


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device, width: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not prompts:
        raise ValueError("sampling: no prompts")
    width = max([width, *(len(p) for p in prompts)])
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt #{i} has no tokens")
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def sample(next_logits: NextLogits, prompts: Sequence[Sequence[int]], keys: Sequence[tuple[int, int]],
           settings: SamplingSettings, seed: int, step: int, new_cache: Callable[[int], object],
           device: torch.device | str = "cpu", keep_going: Callable[[bool], bool] | None = None,
           width: int = 0) -> list[Completion]:
    """A completion of each prompt; ``keys[i]`` = (prompt index, completion index) seeds row i's stream.

    ``new_cache(tokens)``: an empty KV cache for rows of up to ``tokens`` tokens (``hf_cache(model)``).
    ``keep_going(local_unfinished)``: whether to run another step; by default while a row here is unfinished
    (under FSDP: the all-ranks answer). ``width``: the prompts are left-padded to at least this many tokens
    (the widest of every rank's, in lockstep)."""
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
    device = torch.device(device)
    generators = [completion_generator(seed, step, p, c) for p, c in keys]
    ids, mask, positions = _left_padded(prompts, settings.pad_id, device, width)
    cache = new_cache(ids.size(1) + settings.max_new_tokens)
    eos = set(settings.eos_ids)
    done = [False] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    logits = next_logits(ids, mask, positions, cache)
    for t in range(settings.max_new_tokens):
        picked = pick(logits, settings, generators).tolist()  # the step's one device-to-host copy
        for i, token in enumerate(picked):
            if not done[i]:
                out[i].append(token)
                done[i] = token in eos
        unfinished = not all(done)
        if t == settings.max_new_tokens - 1 or not (keep_going(unfinished) if keep_going else unfinished):
            break
        # a finished row is fed padding (its logits are never read again); the batch keeps its shape
        tokens = torch.tensor([settings.pad_id if d else tok for d, tok in zip(done, picked)], device=device)
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        positions = positions[:, -1:] + 1
        logits = next_logits(tokens.unsqueeze(1), mask, positions, cache)
    return [Completion(ids, truncated=not ids or ids[-1] not in eos) for ids in out]


def hf_cache(model: nn.Module) -> Callable[[int], object]:
    """An empty ``StaticCache`` of ``model`` for rows of up to the given tokens (its config gives sliding-window
    layers their own kind).

    Why static: the rows' length is known before the first token (prompt width + max_new_tokens), so each
    layer's keys and values are allocated once and written in place. A ``DynamicCache`` concatenates each
    layer's whole cache with every new token: a copy of the cache per token, and on the CPU a new block of a
    slightly larger size each time, which leaves holes in the heap that the next token's block cannot use."""
    from transformers import StaticCache

    config = getattr(model, "config", None)
    return lambda tokens: StaticCache(config=config, max_cache_len=tokens)


def hf_next_logits(model: nn.Module) -> NextLogits:
    """``next_logits`` of a Hugging Face causal LM (or a peft / FSDP wrapper of one), last position only."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # transformers 5.2x renamed past_key_values to cache (the old name warns from then on)
    key = "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"

    def next_logits(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: object) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **{key: cache})
        return out.logits[:, -1]
    return next_logits


def stop_ids(model: nn.Module, tokenizer) -> list[int]:
    """End-of-answer tokens: the tokenizer's eos and whatever the model's generation config adds."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)
