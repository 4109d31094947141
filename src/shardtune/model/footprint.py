"""What a model needs in memory, found without its weights: config.json, a meta model, headers.

Sizes come from the model built on the meta device with LoRA injected (model.py) and from the
safetensors headers. Activations are not guessed from a formula: one forward pass runs on fake
tensors (shapes and dtypes only: no memory, no arithmetic, but the real kernels' choices, e.g. the
attention path for the device) and records every tensor autograd saves for backward, per decoder
layer. plan.py turns these facts into per-rank peaks.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from shardtune.config import Config
from shardtune.model.directory import ModelDir, check_model_dir
from shardtune.model.lora import inject_lora
from shardtune.model.meta import DTYPES, build_meta_model
from shardtune.model.structure import decoder_layers, embedding_tables, layer_parts, tables_by_rows


@dataclass
class Facts:
    """What the plan needs to know about the model, read from config.json and the headers."""

    total_params: int
    trainable_params: int
    frozen_bytes: int  # frozen weights in the model dtype
    compute_itemsize: int
    layers: int
    block_bytes: int  # the largest decoder layer, in the compute dtype
    embed_bytes: int  # input embedding, in the compute dtype
    head_bytes: int  # output embedding when untied; 0 when tied
    tables_by_rows: dict[str, bool]  # which tables FSDP2 uses from row shards instead of gathering them
    units_bytes: list[int]  # FSDP2's units of the largest decoder layer, in the order backward meets them
    root_bytes: int  # all weights outside the decoder layers, in the compute dtype
    hidden: int
    checkpoint_bytes: int
    #: {(micro-batch size, LoRA weight dtype): (saved bytes per decoder layer, outside them, vocabulary)}
    saved: dict[tuple[int, torch.dtype], tuple[list[int], int, int]] = field(default_factory=dict)


def safetensors_header(path: Path) -> dict:
    """A safetensors file's header (names, dtypes, shapes, offsets); the data is never touched."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def checkpoint_bytes(model_dir: ModelDir) -> int:
    headers = list(model_dir.remote_headers.values()) or [safetensors_header(f) for f in model_dir.weight_files]
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for h in headers for t in h.values())


def _unique_params(module: nn.Module) -> dict[int, nn.Parameter]:
    return {id(p): p for p in module.parameters()}


def _saved_bytes(model: nn.Module, batch: int, seq: int, lora_dtype: torch.dtype,
                 device: torch.device) -> tuple[list[int], int, int]:
    """Bytes autograd saves for backward per decoder layer and outside them, and the vocabulary.

    One forward pass on fake tensors: the real kernels' shapes and dtypes (and the real attention
    path for ``device``), no memory and no arithmetic.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    layers = decoder_layers(model)
    per_layer, other, where = [0] * len(layers), [0], [-1]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -1)))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        params = {n: torch.empty(p.shape, dtype=lora_dtype if p.requires_grad else p.dtype, device=device,
                                 requires_grad=p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: mode.from_tensor(b).to(device) for n, b in model.named_buffers()}
        skip = {t.untyped_storage()._cdata for t in params.values()}
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in skip and key not in seen:
                seen.add(key)
                nbytes = t.untyped_storage().nbytes()
                if where[0] >= 0:
                    per_layer[where[0]] += nbytes
                else:
                    other[0] += nbytes
            return t

        ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = functional_call(model, {**params, **buffers}, (), {"input_ids": ids}).logits
        finally:
            for h in hooks:
                h.remove()
    return per_layer, other[0], int(logits.shape[-1])


def _units_bytes(layer: nn.Module, dtype: torch.dtype) -> list[int]:
    """FSDP2's units of one layer (parallel/fsdp2.py), each holding what its sub-units do not."""
    units, seen, sizes = layer_parts(layer), set(), []
    for unit in units:  # innermost first, so what a unit holds is what earlier ones did not take
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own) * dtype.itemsize)
    return sizes[::-1]  # post-forward order is innermost first; backward runs it in reverse


def model_facts(cfg: Config, micro_batches: set[int], lora_dtypes: set[torch.dtype], device: torch.device) -> Facts:
    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code, weights=False)
    dtype = DTYPES[cfg.model.dtype]
    model, _ = inject_lora(build_meta_model(model_dir, dtype), cfg.lora, cfg.train.seed)
    base = model.get_base_model()
    params = _unique_params(model)
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in params.values() if not p.requires_grad)
    layers = decoder_layers(model)
    in_layers = {i for layer in layers for i in _unique_params(layer)}
    embed, head, tied = embedding_tables(model)
    largest = max(layers, key=lambda layer: sum(p.numel() for p in layer.parameters()), default=None)
    facts = Facts(
        total_params=sum(p.numel() for p in params.values()), trainable_params=trainable,
        frozen_bytes=frozen, compute_itemsize=dtype.itemsize, layers=len(layers),
        block_bytes=sum(p.numel() for p in largest.parameters()) * dtype.itemsize if largest else 0,
        embed_bytes=sum(p.numel() for p in embed.parameters()) * dtype.itemsize if embed else 0,
        head_bytes=0 if tied or head is None else sum(p.numel() for p in head.parameters()) * dtype.itemsize,
        tables_by_rows=tables_by_rows(embed, head, tied),
        units_bytes=_units_bytes(largest, dtype) if largest else [],
        root_bytes=sum(p.numel() for i, p in params.items() if i not in in_layers) * dtype.itemsize,
        hidden=int(base.config.hidden_size), checkpoint_bytes=checkpoint_bytes(model_dir),
    )
    for micro in micro_batches:
        for lora_dtype in lora_dtypes:
            facts.saved[micro, lora_dtype] = _saved_bytes(model, micro, cfg.data.seq_len, lora_dtype, device)
    return facts
