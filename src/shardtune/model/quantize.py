"""4-bit NormalFloat (NF4) base weights: which weights, and the rules a sharded NF4 weight follows.

The pieces: this module (which weights, their size, the rules, meta tensors, whole-weight
quantization), nf4_fill.py (a rank quantizing its slice), nf4_torchao.py (torchao's tensor and
bit-exact replacements of two of its methods).

The frozen ``nn.Linear`` weights inside the decoder layers become torchao ``NF4Tensor`` s (block 64,
double-quantized scalers). Everything here keeps one promise: **the 4-bit values a rank holds do not
depend on the world size** — the slice rank r quantizes is bit for bit the same rows of the whole
weight quantized at once on one process (``quantize_whole``). Two things in torchao 0.18 break that
if used naively, and are handled here and in nf4_fill.py:

- ``to_nf4`` subtracts the mean of *all* of a tensor's block scalers before quantizing them (one
  number per tensor). A slice quantized alone would use its own mean, and FSDP2's
  ``fsdp_post_all_gather`` rebuilds the gathered weight with the local rank's mean. So the ranks
  all-gather their block absmaxes (an all-gather keeps the values and their order; an all-reduce's
  summation order would differ) and every rank computes the whole tensor's mean as ``to_nf4`` does.
- ``to_nf4`` needs the number of blocks to be a multiple of the scaler block (256 by default), and
  a row slice must not cut a scaler block. We pick, per tensor, the largest scaler block (≤ 256) that
  divides the 64-element blocks of one row: every row split is then aligned, whatever the world size.
  (bitsandbytes always uses 256 scalers per block; ours are at most that, so slightly more exact.)

A Linear whose rows are not whole 64-element blocks stays in the compute dtype (listed in a warning);
FSDP2 refuses a weight whose rows do not split evenly over the ranks (torchao's split needs that).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.config import ConfigError, traits
from shardtune.model.nf4_torchao import BLOCK, MAX_SCALER_BLOCK, nf4_module
from shardtune.runplan import RunPlan
from shardtune.runtime.logs import EVERY_RANK

log = logging.getLogger("shardtune")

NF4_CHOICES = ("none", "nf4")


def check_available() -> None:
    """Fail before anything is loaded when torchao is missing (``--quantize nf4``)."""
    nf4_module()


def scaler_block_size(cols: int) -> int | None:
    """Scalers per double-quantization block for a weight with ``cols`` columns; None: not quantizable.

    The largest divisor of the blocks in one row that is at most 256, so that scaler blocks never
    straddle rows and any split by rows is aligned to them.
    """
    if cols % BLOCK:
        return None
    per_row = cols // BLOCK
    return max(d for d in range(1, min(per_row, MAX_SCALER_BLOCK) + 1) if per_row % d == 0)


def bits_per_weight(rows: int, cols: int, dtype_bytes: int = 2) -> float:
    """Storage of one NF4 weight: 4 bits + an int8 scaler per block + one factor per scaler block."""
    sbs = scaler_block_size(cols)
    assert sbs is not None
    blocks = rows * cols // BLOCK
    total_bits = rows * cols * 4 + blocks * 8 + blocks // sbs * dtype_bytes * 8 + dtype_bytes * 8
    return total_bits / (rows * cols)


def nf4_bytes(rows: int, cols: int, dtype_bytes: int = 2) -> int:
    return math.ceil(bits_per_weight(rows, cols, dtype_bytes) * rows * cols / 8)


@dataclass
class Selection:
    """Which Linear weights become NF4 (their module names) and which stay, with the reason."""

    quantized: dict[str, nn.Linear]
    kept: dict[str, str]


def select(model: nn.Module) -> Selection:
    """The frozen ``nn.Linear`` weights inside the decoder layers: attention and MLP projections,
    adapted by LoRA (peft's ``base_layer``) or not. Embeddings, norms, biases and the head are not."""
    from shardtune.model.structure import decoder_layers

    quantized: dict[str, nn.Linear] = {}
    kept: dict[str, str] = {}
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    for name, module in model.named_modules():
        if id(module) not in inside or type(module) is not nn.Linear or module.weight.requires_grad:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")  # as the checkpoint names it
        rows, cols = module.weight.shape
        if scaler_block_size(cols) is None:
            kept[name] = f"{cols} input features are not a multiple of {BLOCK}"
        else:
            quantized[name] = module
    return Selection(quantized, kept)


def check_sharding(selection: Selection, plan: RunPlan) -> None:
    """The rule of NF4 weights under a run plan, checked by ``resolve`` before the workers start and by
    every rank before it loads (``load_sharded`` has no resolve before it): a strategy that shards
    splits each quantized weight by rows over the ranks of one replica group (which strategies take
    nf4 at all is ``config.combination_refusal``)."""
    if traits(plan.strategy).shards:
        check_even_split(selection, plan.world_size // plan.replicate_groups)


def check_even_split(selection: Selection, world_size: int) -> None:
    """FSDP2 shards by rows; torchao's NF4 split needs every rank's share to be equal."""
    uneven = [f"{n} ({m.weight.shape[0]} rows)" for n, m in selection.quantized.items()
              if m.weight.shape[0] % world_size]
    if uneven:
        raise ConfigError(
            f"option 'quantize': nf4 with fsdp2 needs every quantized weight's rows to split evenly over "
            f"the {world_size} ranks, but {', '.join(uneven[:4])}{' …' if len(uneven) > 4 else ''} do not; "
            f"use a number of ranks that divides them, or --strategy ddp"
        )


def warn_kept(selection: Selection) -> None:
    if selection.kept:
        items = [f"{n} ({why})" for n, why in list(selection.kept.items())[:8]]
        log.warning("--quantize nf4: %d Linear weight(s) stay in the compute dtype: %s%s", len(selection.kept),
                    "; ".join(items), " …" if len(selection.kept) > 8 else "", extra=EVERY_RANK)
    if not selection.quantized:
        log.warning("--quantize nf4: no decoder-layer Linear weight can be quantized; the base stays unquantized",
                    extra=EVERY_RANK)


def empty_nf4(shape: tuple[int, int], dtype: torch.dtype, device: torch.device | str = "meta") -> torch.Tensor:
    """An NF4 tensor of this shape with unset contents (on meta: sharded by FSDP2, filled after ``to_empty``)."""
    m = nf4_module()
    rows, cols = shape
    sbs = scaler_block_size(cols)
    n_blocks = rows * cols // BLOCK

    def e(n: int | tuple, dt: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dt, device=device)

    meta = m.SubclassTensorArgs(torch.Size(shape), (cols, 1), 0, dtype, torch.device(device), False)
    return m.NF4Tensor(meta, BLOCK, n_blocks, sbs, e(n_blocks, torch.int8), e(n_blocks // sbs, dtype),
                       e((), dtype), e(rows * cols // 2, torch.uint8), e(16, dtype))


def make_meta_nf4(selection: Selection) -> None:
    """Replace each selected weight (on meta) by an NF4 parameter of the same shape and dtype."""
    for module in selection.quantized.values():
        w = module.weight
        module.weight = nn.Parameter(empty_nf4(tuple(w.shape), w.dtype), requires_grad=False)


def quantize_whole(weight: torch.Tensor) -> torch.Tensor:
    """The whole weight quantized at once on one process: the reference every shard must match."""
    sbs = scaler_block_size(weight.shape[1])
    if sbs is None:
        raise ValueError(f"a weight with {weight.shape[1]} columns is not a whole number of {BLOCK}-blocks per row")
    return nf4_module().to_nf4(weight.contiguous(), BLOCK, sbs)


def quantize_in_place(model: nn.Module, source_dtype: torch.dtype | None = None) -> Selection:
    """Quantize a real (loaded) model's selected weights one at a time: the whole-model reference (tests).

    ``source_dtype``: the dtype the weights are quantized from, which fixes the NF4 values; training
    quantizes from its ``--dtype``, so that dtype reproduces its base (default: the weights' own).
    """
    model.requires_grad_(False)
    selection = select(model)
    warn_kept(selection)
    for module in selection.quantized.values():
        w = module.weight.detach()
        module.weight = nn.Parameter(quantize_whole(w.to(source_dtype or w.dtype)), requires_grad=False)
    return selection
