"""4-bit NormalFloat (NF4) base weights: which weights, how a rank quantizes its slice, torchao's tensor.

The frozen ``nn.Linear`` weights inside the decoder layers become torchao ``NF4Tensor`` s (block 64,
double-quantized scalers). Everything here keeps one promise: **the 4-bit values a rank holds do not
depend on the world size** — the slice rank r quantizes is bit for bit the same rows of the whole
weight quantized at once on one process (``quantize_whole``). Two things in torchao 0.18 break that
if used naively, and are handled here:

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

import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardtune.config import ConfigError
from shardtune.runtime.logs import EVERY_RANK, import_quietly

log = logging.getLogger("shardtune")

BLOCK = 64  # weights per absmax scaler (QLoRA's block size)
MAX_SCALER_BLOCK = 256  # scalers per double-quantization factor (QLoRA's, torchao's default)
NF4_CHOICES = ("none", "nf4")


def nf4_module():
    """torchao's NF4 module (imported quietly); a ConfigError saying how to install torchao if it is missing."""
    try:
        module = import_quietly("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    except ImportError as err:
        raise ConfigError(
            f"option 'quantize': nf4 needs torchao ({err}); install it with `pip install torchao` "
            "(or `pip install 'shardtune[qlora]'`)"
        ) from None
    _use_lean_dequantization(module.NF4Tensor)
    _use_fast_nearest(module.NF4Tensor)
    return module


DEQUANT_CHUNK = 1 << 20  # packed bytes (2 weights each) dequantized at a time


def dequantize(t: torch.Tensor, original=None) -> torch.Tensor:
    """``NF4Tensor.get_original_weight``, the same values bit for bit, in a fraction of the memory.

    torchao's version holds two int64 index tensors and four temporaries of the whole weight at once:
    about 14 bytes per bf16 weight, for each weight forward and backward dequantize (measured on a
    4096 × 11008 weight: ~630 MB above the 90 MB result). Here the result is written a chunk of
    blocks at a time, with the same elementwise products.
    """
    scalers = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_block_size)
    half = t.block_size // 2  # packed bytes per block
    # Each packed byte holds two codes: one lookup in a 256-entry table of value pairs replaces two
    # lookups with int64 indices (the same values, so the same products below).
    pairs = torch.stack([t.nf4[torch.arange(256) >> 4], t.nf4[torch.arange(256) & 0b1111]], dim=-1)
    packed = t.quantized_data
    out = torch.empty(packed.numel() // half, half, 2, dtype=t.dtype, device=packed.device)
    blocks = max(1, DEQUANT_CHUNK // half)
    for first in range(0, out.shape[0], blocks):
        codes = packed[first * half:(first + blocks) * half].to(torch.int32)
        chunk = pairs.index_select(0, codes).view(-1, half, 2)
        torch.mul(chunk, scalers[first:first + blocks, None, None], out=out[first:first + blocks])
    return out.view(t.shape)


def _use_lean_dequantization(cls: type) -> None:
    """Route torchao's dequantization (every NF4 linear, forward and backward) through ``dequantize``.

    A method of torchao's class is replaced; it is checked here, on a small tensor, to give exactly
    what torchao's own gives, so a torchao change fails loudly instead of computing something else."""
    if getattr(cls, "_shardtune_lean", False):
        return
    probe = cls.from_tensor(torch.linspace(-3, 5, 4 * 2 * BLOCK).reshape(4, 2 * BLOCK), BLOCK, 2)
    if not torch.equal(dequantize(probe), cls.get_original_weight(probe)):
        raise RuntimeError("torchao's NF4Tensor dequantizes differently than shardtune expects: "
                           "shardtune's NF4 support needs updating for this torchao version")
    cls._torchao_get_original_weight = cls.get_original_weight
    cls.get_original_weight = dequantize
    cls._shardtune_lean = True


def nearest_code(value: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """``NF4Tensor.quantize_tensor_nearest``: the index of the NF4 value closest to each element (the
    first on a tie; as uint8, what torchao stores it as), bit for bit, without its (n, 16) distance
    matrix (which made a 1.1B model's NF4 load take 256 s against 10 s for bf16).

    16-bit values (bf16, fp16) have 65536 bit patterns: a table of torchao's answer for each, looked
    up. Wider values (fp32; scaled to [-1, 1] by their block's absmax) go through a grid of 2^16 bins:
    a bin far from every midpoint between two codes has one nearest code, looked up; values in the
    few bins near a midpoint, where rounding in ``|value - code|`` can decide, are decided as torchao
    decides them, from the same differences, the lower index winning a tie.
    """
    if value.element_size() == 2:
        bits = value.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        return _pattern_codes(value.dtype, nf4).index_select(0, bits.flatten()).view(value.shape)
    codes_of_bin, near_bin = _grid(nf4)
    flat = value.flatten()
    # clamped after the cast too: a NaN casts to INT_MIN (non-finite values go to torchao's rule below)
    bins = ((flat.clamp(-1, 1) + 1) * GRID_HALF).to(torch.int32).clamp_(0, 2 * GRID_HALF)
    codes = codes_of_bin.index_select(0, bins)
    near = (near_bin.index_select(0, bins) | ~torch.isfinite(flat)).nonzero().squeeze(1)
    if near.numel():
        codes[near] = _torchao_nearest(flat[near], nf4).to(torch.uint8)
    return codes.view(value.shape)


GRID_HALF = 1 << 15  # bins per unit: 2^16 bins over [-1, 1]


def _torchao_nearest(value: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """torchao's definition itself (for the few values the fast paths leave open)."""
    return (value.unsqueeze(-1) - nf4).abs().min(dim=-1).indices


@functools.cache
def _pattern_codes_cached(dtype: torch.dtype, nf4: tuple[float, ...]) -> torch.Tensor:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    order = torch.argsort(patterns.view(torch.int16).to(torch.int32) & 0xFFFF)
    return _torchao_nearest(patterns[order], torch.tensor(nf4, dtype=dtype)).to(torch.uint8)


def _pattern_codes(dtype: torch.dtype, nf4: torch.Tensor) -> torch.Tensor:
    """Code of every 16-bit pattern, indexed by the pattern as an unsigned number."""
    return _pattern_codes_cached(dtype, tuple(nf4.tolist())).to(nf4.device)


def _grid(nf4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nearest code of each grid bin, whether a midpoint between codes lies within two bins of it)."""
    return tuple(t.to(nf4.device) for t in _grid_cached(tuple(nf4.double().tolist())))


@functools.cache
def _grid_cached(nf4: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    edges = torch.arange(2 * GRID_HALF + 2, dtype=torch.float64) / GRID_HALF - 1  # bin b: [edges[b], edges[b+1])
    lut = torch.tensor(nf4, dtype=torch.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    codes = (centers.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)
    mids = (lut[1:] + lut[:-1]) / 2
    margin = 2.0 / GRID_HALF  # two bins: float rounding of the bin index, and of the midpoints
    near = ((mids >= edges[:-1, None] - margin) & (mids <= edges[1:, None] + margin)).any(dim=-1)
    return codes, near


def _use_fast_nearest(cls: type) -> None:
    """Route torchao's nearest-code search (every quantization) through ``nearest_code``, after checking
    on values at, around and between every pair of codes that both give the same indices."""
    if getattr(cls, "_shardtune_fast_nearest", False):
        return
    for dtype in (torch.float32, torch.bfloat16):
        nf4 = torch.linspace(-3, 5, 4 * 2 * BLOCK).reshape(4, 2 * BLOCK).to(dtype)
        lut = cls.from_tensor(nf4, BLOCK, 2).nf4
        mids = (lut[1:] + lut[:-1]) / 2
        probe = torch.cat([lut, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                           torch.linspace(-1.2, 1.2, 4001, dtype=dtype), torch.rand(4096).to(dtype) * 2 - 1,
                           torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=dtype)])
        if not torch.equal(nearest_code(probe, lut).long(), cls.quantize_tensor_nearest(probe, lut)):
            raise RuntimeError("torchao's NF4Tensor picks codes differently than shardtune expects: "
                               "shardtune's NF4 support needs updating for this torchao version")
    cls._torchao_quantize_tensor_nearest = cls.quantize_tensor_nearest
    cls.quantize_tensor_nearest = staticmethod(nearest_code)
    cls._shardtune_fast_nearest = True


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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor object itself (a DTensor's own local tensor: ``to_local()`` returns a new NF4 view,
    and FSDP2 all-gathers from the DTensor's ``_local_tensor``, whose per-tensor fields we set)."""
    return getattr(t, "_local_tensor", t)


def is_nf4(t: torch.Tensor) -> bool:
    return type(local_tensor(t)).__name__ == "NF4Tensor"


QUANT_CHUNK = 1 << 20  # weights quantized at a time: temporaries stay a few MB, not a few slices


def block_absmax(rows: torch.Tensor) -> torch.Tensor:
    """Each 64-weight block's largest magnitude (``get_block_absmax``), without a whole ``abs`` copy."""
    blocks = rows.reshape(-1, BLOCK)
    out = torch.empty(blocks.shape[0], dtype=rows.dtype, device=rows.device)
    step = QUANT_CHUNK // BLOCK
    for first in range(0, blocks.shape[0], step):
        torch.amax(blocks[first:first + step].abs(), dim=1, out=out[first:first + step])
    return out


def shared_scaler_mean(absmax: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The mean of the whole tensor's block absmaxes, as ``to_nf4`` computes it, on every rank.

    ``absmax``: this rank's blocks (ranks hold consecutive, equal row ranges). Gathered in rank order
    and averaged in one ``mean`` over the same values, so every rank gets exactly the single-process number.
    """
    if group is None or dist.get_world_size(group) == 1:
        return absmax.mean()
    parts = [torch.empty_like(absmax) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, absmax.contiguous(), group=group)
    return torch.cat(parts).mean()


def quantize_rows(rows: torch.Tensor, scaler_mean: torch.Tensor, scaler_block: int,
                  absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(quantized_scalers, quantization_factor, quantized_data) of whole rows of a weight, given the
    whole tensor's scaler mean: ``NF4Tensor.double_quantize_scalers`` step for step, with the mean
    passed in instead of computed from these rows alone. ``absmax``: ``block_absmax(rows)`` if known."""
    m = nf4_module()
    absmax = block_absmax(rows) if absmax is None else absmax
    scalers = absmax - scaler_mean
    n_scaler_blocks = scalers.numel() // scaler_block
    blocks = scalers.view(n_scaler_blocks, scaler_block)
    scaler_absmax = m.get_block_absmax(scalers, scaler_block).unsqueeze(-1).expand(n_scaler_blocks, scaler_block)
    factor = 256 / (2 * scaler_absmax)
    quantized_scalers = (blocks * factor).round().clamp(-128, 127).flatten().to(torch.int8)
    factor = factor[:, 0].contiguous()
    data = norm_float_codes(rows, nf4_lut(rows.dtype, rows.device), absmax)
    return quantized_scalers, factor, data


def norm_float_codes(rows: torch.Tensor, lut: torch.Tensor, absmax: torch.Tensor | None = None) -> torch.Tensor:
    """``NF4Tensor.convert_to_norm_float_weight``: each weight over its block's absmax, the nearest
    code, two codes a byte; the same elementwise operations (so the same bytes), a chunk at a time
    (torchao's holds the whole scaled copy and int64 codes: ~3 slices more at load)."""
    blocks = rows.reshape(-1, BLOCK)
    absmax = block_absmax(rows) if absmax is None else absmax
    codes = torch.empty(blocks.numel(), dtype=torch.uint8, device=rows.device)
    step = QUANT_CHUNK // BLOCK
    for first in range(0, blocks.shape[0], step):
        scaled = blocks[first:first + step] / absmax[first:first + step].unsqueeze(-1)
        codes[first * BLOCK:(first + step) * BLOCK] = nearest_code(scaled.flatten(), lut)
    return codes[::2] << 4 | codes[1::2]


@functools.cache
def nf4_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 NF4 code values, taken from a tensor ``NF4Tensor.from_tensor`` builds (it owns the table)."""
    probe = torch.arange(2 * BLOCK, dtype=dtype, device=device)
    return nf4_module().NF4Tensor.from_tensor(probe, BLOCK, 2).nf4


def fill(target: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Quantize ``rows`` (this rank's slice of the weight, in the compute dtype) into the NF4 ``target``
    (the parameter, or a DTensor's local NF4 shard) in place. A collective when ``group`` has ranks."""
    local = local_tensor(target)
    if tuple(rows.shape) != tuple(local.shape):
        raise RuntimeError(f"NF4 fill: slice {tuple(rows.shape)} does not match the shard {tuple(local.shape)}")
    with torch.no_grad():
        absmax = block_absmax(rows)
        mean = shared_scaler_mean(absmax, group)
        scalers, factor, data = quantize_rows(rows, mean, local.scaler_block_size, absmax)
        local.quantized_scalers.copy_(scalers)
        local.quantization_factor.copy_(factor)
        local.quantized_data.copy_(data)
        # to_empty allocates only the three sharded inner tensors; these two are per tensor
        local.scaler_mean = mean.to(local.device)
        local.nf4 = nf4_lut(rows.dtype, local.device)


def quantize_whole(weight: torch.Tensor) -> torch.Tensor:
    """The whole weight quantized at once on one process: the reference every shard must match."""
    sbs = scaler_block_size(weight.shape[1])
    if sbs is None:
        raise ValueError(f"a weight with {weight.shape[1]} columns is not a whole number of {BLOCK}-blocks per row")
    return nf4_module().to_nf4(weight.contiguous(), BLOCK, sbs)


def quantize_in_place(model: nn.Module, source_dtype: torch.dtype | None = None) -> Selection:
    """Quantize a real (loaded) model's selected weights one at a time (eval, generate: nothing trains).

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


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """The weight an NF4 tensor stands for, in its dtype (what forward computes with)."""
    return t.get_original_weight()
