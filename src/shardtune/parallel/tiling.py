"""Tiled MLP: each decoder layer's MLP computed a tile of tokens at a time, recomputed tile by tile in backward.

At long context, once the layers' checkpointed inputs and the logits are small, the peak is one layer's
own temporaries while backward recomputes it, and the MLP's are the widest: gate, up and their product,
each tokens × intermediate (2.7–3.5× the hidden size), plus LoRA's. Tiled over the sequence, with each
tile a checkpoint of its own, only one tile's set exists at a time, in forward and in backward (ALST's
and unsloth's "tiled MLP"). The MLP is a per-token function, so the result is the same up to float
summation order; a tile's LoRA dropout is replayed exactly (checkpoints restore the RNG).

It costs one more MLP forward per layer (the tiles' recomputation), which is why the planner turns it on
only when a run does not fit without it. Under FSDP2 with per-part units every tile gathers the MLP's
projections again, so tiling goes with whole-layer units.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtune.model.structure import mlp_of


def _tiled(forward: Callable[[torch.Tensor], torch.Tensor], tile: int) -> Callable[..., torch.Tensor]:
    def tiled_forward(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or hidden.dim() != 3 or hidden.size(1) <= tile:
            return forward(hidden, *args, **kwargs)
        pieces = hidden.split(tile, dim=1)
        if torch.is_grad_enabled():
            outs = [checkpoint(forward, piece, use_reentrant=False) for piece in pieces]
        else:
            outs = [forward(piece) for piece in pieces]
        return torch.cat(outs, dim=1)

    tiled_forward.tile = tile  # type: ignore[attr-defined]
    return tiled_forward


def tile_mlps(layers: list[nn.Module], tile: int) -> int:
    """Make each layer's MLP compute ``tile`` tokens at a time; returns how many MLPs were tiled."""
    if tile < 1:
        raise ValueError(f"an MLP tile holds at least one token, got {tile}")
    done = 0
    for layer in layers:
        mlp = mlp_of(layer)
        if mlp is None:
            continue
        original = getattr(mlp.forward, "__wrapped_forward__", mlp.forward)
        mlp.forward = _tiled(original, tile)
        mlp.forward.__wrapped_forward__ = original  # type: ignore[attr-defined]
        done += 1
    return done
