"""A rank quantizes its own slice of a weight into its NF4 shard, bit for bit as torchao quantizes
the whole weight at once (see quantize.py for why that needs the whole tensor's scaler mean).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from shardtune.model.nf4_torchao import BLOCK, nearest_code, nf4_module
from shardtune.runtime.compat import dtensor_local


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor object itself (a DTensor's own local tensor: ``to_local()`` returns a new NF4 view,
    and FSDP2 all-gathers from the DTensor's local tensor, whose per-tensor fields we set)."""
    return dtensor_local(t)


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
