"""torchao's NF4 tensor, and bit-exact, leaner replacements for three of its operations.

``nf4_module`` imports torchao's NF4 module and routes ``NF4Tensor``'s dequantization, nearest-code
search and ``F.linear`` through the versions here, after checking on a probe that they give exactly
torchao's values: the same 4-bit data as torchao, in a fraction of the memory and time. A torchao
whose results differ fails loudly at import instead of computing something else. The module's
private path, its fields and the routing are runtime/compat's (``nf4_tensor_module``,
``route_nf4_method``, ``route_nf4_torch_function``); the probes, which say what "the same" means, are here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from shardtune.config import ConfigError
from shardtune.runtime import compat
from shardtune.runtime.logs import import_quietly

BLOCK = 64  # weights per absmax scaler (QLoRA's block size)
MAX_SCALER_BLOCK = 256  # scalers per double-quantization factor (QLoRA's, torchao's default)


def nf4_module():
    """torchao's NF4 module (imported quietly); a ConfigError saying how to install torchao if it is missing."""
    try:
        module = compat.nf4_tensor_module(import_quietly)
    except ImportError as err:
        raise ConfigError(
            f"option 'quantize': nf4 needs torchao ({err}); install it with `pip install torchao` "
            "(or `pip install 'shardtune[qlora]'`)"
        ) from None
    compat.route_nf4_method(module, "get_original_weight", dequantize, _same_dequantization(module))
    compat.route_nf4_method(module, "quantize_tensor_nearest", nearest_code, _same_nearest(module), static=True)
    compat.route_nf4_torch_function(module, F.linear, linear, _same_linear(module))
    return module


DEQUANT_CHUNK = 1 << 20  # packed bytes (2 weights each) dequantized at a time

#: Inside ``dequantized_once``: each NF4 weight (by identity) and its dequantized values, kept.
_kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


@contextlib.contextmanager
def dequantized_once() -> Iterator[None]:
    """Inside, each NF4 weight is dequantized at its first use and its values are kept for every later
    one, until the block ends (then they are let go): for many no_grad forwards of weights that do not
    change (GRPO's generation, a forward per token). The same values as dequantizing in every forward,
    for the memory of every weight used in the compute dtype."""
    global _kept
    outer, _kept = _kept, {} if _kept is None else _kept
    try:
        yield
    finally:
        _kept = outer


#: Inside ``recompute_keeps_values``: an NF4 matmul saves its weight's dequantized values for backward.
_saving_values = 0


@contextlib.contextmanager
def recompute_keeps_values() -> Iterator[None]:
    """Inside, each NF4 matmul saves its weight's dequantized values for its backward, not the NF4 weight:
    the backward then does not dequantize the weight again. For activation checkpointing's forward and
    recompute of a layer (``checkpoint_contexts``): the forward's saved tensors are dropped by the
    checkpoint, so the values cost nothing there; the recompute's live until each weight's backward, a
    layer's worth at most (the planner counts it: ``RunPlan.recompute_dequantized``). One dequantization
    of each weight fewer per micro-batch, the same values."""
    global _saving_values
    _saving_values += 1
    try:
        yield
    finally:
        _saving_values -= 1


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn``: its forward and its recompute, each ``recompute_keeps_values``."""
    return recompute_keeps_values(), recompute_keeps_values()


class NF4Linear(torch.autograd.Function):
    """torchao's ``LinearNF4`` (``F.linear`` on an NF4 weight): the input's gradient from the dequantized
    weight, the weight frozen; the same values. Saves the NF4 weight for backward, or inside
    ``recompute_keeps_values`` the values it dequantized (converted to the gradient's dtype in backward, as
    torchao converts the weight)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, input: torch.Tensor, weight: torch.Tensor
                ) -> torch.Tensor:
        values = values_in(weight, input.dtype)
        ctx.save_for_backward(values if _saving_values else weight)
        return F.linear(input, values)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        (weight,) = ctx.saved_tensors
        return grad_output @ values_in(weight, grad_output.dtype), None


def values_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An NF4 weight's values in ``dtype`` (a plain tensor's, converted), as torchao's ``weight.to(dtype)`` gives
    them: dequantized in the weight's own dtype, then converted; without the tensor subclass's dispatch of
    ``to``, which a token's forward pays for every weight."""
    values = dequantize(weight) if type(weight) is not torch.Tensor else weight
    return values if values.dtype == dtype else values.to(dtype)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on an NF4 weight, as torchao's (the bias added after the product). Where no gradient can
    flow (generation's forwards, no_grad), the product alone, without an autograd function to apply."""
    if torch.is_grad_enabled() and input.requires_grad:
        out = NF4Linear.apply(input, weight)
    else:
        out = F.linear(input, values_in(weight, input.dtype))
    return out if bias is None else out + bias


def _same_linear(module):
    """Whether ``linear`` gives exactly torchao's ``F.linear`` output and input gradient on a probe, saving
    the NF4 weight and saving its values, and its output without gradients, with a bias and without."""

    def agrees(original) -> bool:
        weight = module.NF4Tensor.from_tensor(torch.linspace(-3, 5, 4 * 2 * BLOCK).reshape(4, 2 * BLOCK), BLOCK, 2)
        # fixed values: a probe must not draw from the caller's random stream
        x, bias = torch.linspace(-1, 1, 3 * 2 * BLOCK).reshape(3, 2 * BLOCK), torch.ones(4)
        grad = torch.linspace(-2, 3, 12).reshape(3, 4)

        def run(fn, *extra) -> tuple[torch.Tensor, torch.Tensor]:
            leaf = x.clone().requires_grad_()
            out = fn(leaf, weight, *extra)
            out.backward(grad)
            return out.detach(), leaf.grad

        for extra in ((), (bias,)):
            expected = run(original, *extra)
            with recompute_keeps_values():
                kept = run(linear, *extra)
            if not all(torch.equal(a, b) for a, b in zip((*run(linear, *extra), *kept), expected * 2)):
                return False
            with torch.no_grad():  # the product alone
                if not torch.equal(linear(x, weight, *extra), original(x, weight, *extra)):
                    return False
        return True

    return agrees


def dequantize(t: torch.Tensor, original=None) -> torch.Tensor:
    """``NF4Tensor.get_original_weight``, the same values bit for bit, in a fraction of the memory.

    torchao's version holds two int64 index tensors and four temporaries of the whole weight at once,
    several times the result's size, for each weight forward and backward dequantize. Here the result
    is written a chunk of blocks at a time, with the same elementwise products. Inside
    ``dequantized_once`` each weight's values are made once and reused.
    """
    if _kept is None:
        return _dequantize(t)
    if id(t) not in _kept:  # the weight is held with its values: its id cannot become another's
        _kept[id(t)] = (t, _dequantize(t))
    return _kept[id(t)][1]


def _dequantize(t: torch.Tensor) -> torch.Tensor:
    scalers = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_block_size)
    half = t.block_size // 2  # packed bytes per block
    pairs = _on_table(t.nf4, "pairs", _value_pairs)
    packed = t.quantized_data
    out = torch.empty(packed.numel() // half, half, 2, dtype=t.dtype, device=packed.device)
    blocks = max(1, DEQUANT_CHUNK // half)
    for first in range(0, out.shape[0], blocks):
        codes = packed[first * half:(first + blocks) * half].to(torch.int32)
        chunk = pairs.index_select(0, codes).view(t.nf4.dtype).view(-1, half, 2)
        torch.mul(chunk, scalers[first:first + blocks, None, None], out=out[first:first + blocks])
    return out.view(t.shape)


#: an integer type as wide as two values of each width: a pair of values looked up as one element
_PAIR_AS = {2: torch.int32, 4: torch.int64}


def _value_pairs(nf4: torch.Tensor) -> torch.Tensor:
    """Each packed byte holds two codes: one lookup in this 256-entry table of value pairs replaces two
    lookups with int64 indices (the same values, so the same products). Each pair is one element, its two
    values' bits as one integer of twice their width: a gather of single elements, several times faster
    than of two-value rows (bench/nf4_dequant.py), and read back as the values by a view."""
    index = torch.arange(256, device=nf4.device)
    pairs = torch.stack([nf4[index >> 4], nf4[index & 0b1111]], dim=-1)
    wide = _PAIR_AS.get(nf4.element_size())
    return pairs if wide is None else pairs.view(wide).view(256)


def _on_table(nf4: torch.Tensor, name: str, build) -> torch.Tensor:
    """``build(nf4)``, made once per code table and kept with it, on its device.

    Dequantization runs in every forward, backward and decode step of every NF4 weight: a table
    made there from CPU indices (or copied from a CPU cache) is a synchronous host-to-GPU copy each
    time. The table tensor is the weight's own (FSDP2 hands the same one to every gathered copy,
    and loading gives every weight of a dtype and device the same one: ``nf4_fill.nf4_lut``)."""
    cache = nf4.__dict__.setdefault("_shardtune_tables", {})
    if name not in cache:
        cache[name] = build(nf4)
    return cache[name]


_PROBED = (torch.float32, torch.bfloat16, torch.float16)  # a value of each width the pair table packs


def _same_dequantization(module):
    """Whether ``dequantize`` gives exactly what torchao's ``get_original_weight`` gives, on a probe of
    each dtype."""

    def agrees(original) -> bool:
        values = torch.linspace(-3, 5, 4 * 2 * BLOCK).reshape(4, 2 * BLOCK)
        probes = [module.NF4Tensor.from_tensor(values.to(dtype), BLOCK, 2) for dtype in _PROBED]
        return all(torch.equal(dequantize(probe), original(probe)) for probe in probes)

    return agrees


def nearest_code(value: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """``NF4Tensor.quantize_tensor_nearest``: the index of the NF4 value closest to each element (the
    first on a tie; as uint8, what torchao stores it as), bit for bit, without its (n, 16) distance
    matrix (which made loading an NF4 model many times slower than loading it in bf16).

    16-bit values (bf16, fp16) have 65536 bit patterns: a table of torchao's answer for each, looked
    up. Wider values (fp32; scaled to [-1, 1] by their block's absmax) go through a grid of 2^16 bins:
    a bin far from every midpoint between two codes has one nearest code, looked up; values in the
    few bins near a midpoint, where rounding in ``|value - code|`` can decide, are decided as torchao
    decides them, from the same differences, the lower index winning a tie.
    """
    if value.element_size() == 2:
        bits = value.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        codes = _on_table(nf4, f"patterns-{value.dtype}", lambda t: _pattern_codes(value.dtype, t))
        return codes.index_select(0, bits.flatten()).view(value.shape)
    codes_of_bin, near_bin = _on_table(nf4, "grid", _grid)
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


def _same_nearest(module):
    """Whether ``nearest_code`` picks exactly torchao's ``quantize_tensor_nearest`` codes, on values at,
    around and between every pair of codes, for 32- and 16-bit inputs."""

    def agrees(original) -> bool:
        uniform = torch.rand(4096, generator=torch.Generator().manual_seed(0))  # not the caller's random stream
        for dtype in (torch.float32, torch.bfloat16):
            nf4 = torch.linspace(-3, 5, 4 * 2 * BLOCK).reshape(4, 2 * BLOCK).to(dtype)
            lut = module.NF4Tensor.from_tensor(nf4, BLOCK, 2).nf4
            mids = (lut[1:] + lut[:-1]) / 2
            probe = torch.cat([lut, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                               torch.linspace(-1.2, 1.2, 4001, dtype=dtype), uniform.to(dtype) * 2 - 1,
                               torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=dtype)])
            if not torch.equal(nearest_code(probe, lut).long(), original(probe, lut)):
                return False
        return True

    return agrees
