"""What a model needs in memory, found without its weights: config.json, a meta model, headers.

Sizes come from the model built on the meta device with LoRA injected (model.py) and from the
safetensors headers. Activations are not guessed from a formula: one forward pass runs on fake
tensors (shapes and dtypes only: no memory, no arithmetic, but the real kernels' choices, e.g. the
attention path for the device) and records every tensor autograd saves for backward, per decoder
layer. train/memory_model.py turns these facts into per-rank peaks.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from shardtune.config import Config
from shardtune.model import quantize
from shardtune.model.attention import shardtune_attention
from shardtune.model.directory import ModelDir, ModelDirError, check_model_dir
from shardtune.model.head import head_transform
from shardtune.model.lora import inject_lora
from shardtune.model.meta import build_meta_model, compute_dtype
from shardtune.model.structure import decoder_layers, embedding_tables, layer_parts, mlp_of, tables_by_rows
from shardtune.runtime.compat import LiveBytes, fake_mode, storage_id
from shardtune.runtime.safetensors_header import read_header


@dataclass(frozen=True)
class Saved:
    """What one forward saves for backward: bytes per decoder layer, the part of each that its MLP saves
    (what tiling the MLP turns into one tile's worth, parallel/tiling.py), what the rest of the model
    saves, and the vocabulary (the width of the logits); and, under activation checkpointing, the most
    bytes alive at once while backward recomputes the layer that saves the most and runs through it."""

    per_layer: list[int]
    mlp: list[int]
    outside: int
    vocab: int
    backward: int


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
    #: --quantize nf4: the largest NF4 weight in the compute dtype (dequantized for each matmul) and
    #: the largest weight's slice a rank quantizes while loading; 0 without quantization
    dequant_bytes: int = 0
    quantize_slice_bytes: int = 0
    #: --quantize nf4: all NF4 weights as stored (4-bit codes and their scalers); 0 without quantization
    nf4_bytes: int = 0
    #: --quantize nf4: all NF4 weights in the compute dtype (what GRPO's generation keeps when it
    #: dequantizes each once: RunPlan.generation_dequantized); 0 without quantization
    nf4_dequantized_bytes: int = 0
    #: --quantize nf4: the NF4 weights of the decoder layer that has the most, in the compute dtype (what a
    #: layer's recompute keeps for its backward: RunPlan.recompute_dequantized); 0 without quantization
    nf4_layer_dequantized_bytes: int = 0
    #: whether the loss head scores chunk by chunk (model/head.py); False: the full logits exist
    chunked_head: bool = True
    #: a KV cache's bytes per token over all layers (keys and values, compute dtype): generation (GRPO)
    kv_bytes_per_token: int = 0
    #: the compute dtype (--dtype): LoRA computes in it too (parallel/compute_dtype.py), which sets the
    #: dtype of what its matmuls save; ``saved`` is keyed by it
    dtype: torch.dtype = torch.float32
    #: the row width traced when none is asked for (--seq-len, or the data's longest record)
    seq_len: int = 0
    #: {(micro-batch size, LoRA weight dtype, row width): what it saves for backward}: each found by one
    #: fake-tensor pass, when first asked for (``saved_for``)
    saved: dict[tuple[int, torch.dtype, int], Saved] = field(default_factory=dict)
    #: attention's query and key/value heads and their width (context parallelism's head shares)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    #: the fake-tensor pass of a (micro-batch size, LoRA weight dtype, row width) on the model these facts are of
    trace: Callable[[int, torch.dtype, int], Saved] | None = field(default=None, repr=False, compare=False)

    def saved_for(self, micro_batch: int, lora_dtype: torch.dtype, seq_len: int | None = None) -> Saved:
        """What a micro-batch of ``micro_batch`` rows of ``seq_len`` tokens (default: ``self.seq_len``) saves
        for backward (``saved``), traced once."""
        key = (micro_batch, lora_dtype, seq_len or self.seq_len)
        if key not in self.saved:
            if self.trace is None:
                raise KeyError(key)
            self.saved[key] = self.trace(*key)
        return self.saved[key]


def checkpoint_bytes(model_dir: ModelDir) -> int:
    headers = list(model_dir.remote_headers.values()) or [read_header(f) for f in model_dir.weight_files]
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for h in headers for t in h.values())


def _unique_params(module: nn.Module) -> dict[int, nn.Parameter]:
    return {id(p): p for p in module.parameters()}


def _saved_bytes(model: nn.Module, batch: int, seq: int, lora_dtype: torch.dtype, device: torch.device) -> Saved:
    """Bytes autograd saves for backward per decoder layer (and within it, by its MLP) and outside them,
    and the vocabulary.

    One forward pass on fake tensors: the real kernels' shapes and dtypes (and the real attention
    path for ``device``, with the attention implementation training switches to), no memory and no
    arithmetic.
    """
    from torch.func import functional_call

    layers = decoder_layers(model)
    per_layer, mlp, other, where, in_mlp = [0] * len(layers), [0] * len(layers), [0], [-1], [False]
    inputs: list[tuple[tuple, dict]] = [((), {})] * len(layers)
    hooks = []

    def enter(i: int, args: tuple, kwargs: dict) -> None:
        where[0], inputs[i] = i, (args, kwargs)

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, k, i=i: enter(i, a, k), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -1)))
        if (module := mlp_of(layer)) is not None:
            hooks.append(module.register_forward_pre_hook(lambda m, a: in_mlp.__setitem__(0, True)))
            hooks.append(module.register_forward_hook(lambda m, a, o: in_mlp.__setitem__(0, False)))
    with fake_mode() as mode:
        params = {n: torch.empty(p.shape, dtype=lora_dtype if p.requires_grad else p.dtype, device=device,
                                 requires_grad=p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: mode.from_tensor(b).to(device) for n, b in model.named_buffers()}
        skip = {storage_id(t) for t in params.values()}
        # {storage id: (the storage, weakly; its bytes, the layer saving it, whether in its MLP)}. Only what is
        # still saved when forward ends counts: a part of the graph dropped on the way (DoRA's weight norm,
        # detached) frees what it saved, and its storage's address may then serve a new one, which must count
        # (an address once seen was skipped before: the trace then depended on where the allocator put things).
        saved: dict[int, tuple[weakref.ref, int, int, bool]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_id(t)
            if key not in skip and key not in saved:
                storage = t.untyped_storage()
                saved[key] = (weakref.ref(storage, lambda _, key=key: saved.pop(key, None)), storage.nbytes(),
                              where[0], in_mlp[0])
            return t

        ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        try:
            # the attention training runs (no s×s mask: model/attention.py), not the model's default
            with shardtune_attention(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = functional_call(model, {**params, **buffers}, (), {"input_ids": ids}).logits
        finally:
            for h in hooks:
                h.remove()
        for _, nbytes, i, in_layer_mlp in list(saved.values()):  # alive: ``logits`` holds the graph
            if i >= 0:
                per_layer[i] += nbytes
                mlp[i] += nbytes if in_layer_mlp else 0
            else:
                other[0] += nbytes
        backward = 0
        if layers:
            heaviest = max(range(len(layers)), key=per_layer.__getitem__)
            with shardtune_attention(model):
                backward = _recomputed_backward_bytes(model, layers[heaviest], {**params, **buffers},
                                                      *inputs[heaviest])
    return Saved(per_layer, mlp, other[0], int(logits.shape[-1]), backward)


def _recomputed_backward_bytes(model: nn.Module, layer: nn.Module, tensors: dict[str, torch.Tensor],
                               args: tuple, kwargs: dict) -> int:
    """The most bytes alive at once while backward recomputes ``layer`` (activation checkpointing, as
    training runs it) and runs through it, on the fake inputs the traced forward gave it: its saved
    set, the temporaries of its gradients (which outgrow what is freed as they are made) and the
    gradient it passes down. Traced, not a factor: which tensors overlap depends on the layer's ops."""
    from torch.func import functional_call
    from torch.utils._pytree import tree_map
    from torch.utils.checkpoint import checkpoint

    prefix = next(name for name, module in model.named_modules() if module is layer) + "."
    own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    args, kwargs = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs))
    hidden = (args[0] if args else kwargs["hidden_states"]).requires_grad_(True)

    def forward(h: torch.Tensor) -> torch.Tensor:
        out = (functional_call(layer, own, (h, *args[1:]), kwargs) if args else
               functional_call(layer, own, (), {**kwargs, "hidden_states": h}))
        return out[0] if isinstance(out, tuple) else out

    out = checkpoint(forward, hidden, use_reentrant=False)
    grad = torch.empty_like(out)
    with LiveBytes() as live:
        out.backward(grad)
    return live.peak


def _nbytes(p: torch.Tensor, dtype: torch.dtype, nf4: set[int]) -> int:
    """A weight's size as stored: NF4 (--quantize nf4) or the compute dtype."""
    if id(p) in nf4:
        return quantize.nf4_bytes(p.shape[0], p.shape[1], dtype.itemsize)
    return p.numel() * dtype.itemsize


def _units_bytes(layer: nn.Module, dtype: torch.dtype, nf4: set[int]) -> list[int]:
    """FSDP2's units of one layer (parallel/fsdp2.py), each holding what its sub-units do not (NF4
    weights are gathered packed)."""
    units, seen, sizes = layer_parts(layer), set(), []
    for unit in units:  # innermost first, so what a unit holds is what earlier ones did not take
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        sizes.append(sum(_nbytes(p, dtype, nf4) for p in own))
    return sizes[::-1]  # post-forward order is innermost first; backward runs it in reverse


def model_dir_for_plan(path: str | Path, trust_remote_code: bool = False) -> ModelDir:
    """The model directory (a Hub id brings its safetensors headers only), or a directory (or file) with
    only a config.json: plans need no weights."""
    if Path(path).is_file() and Path(path).name == "config.json":
        return ModelDir(Path(path).parent, [], None, trust_remote_code)
    try:
        return check_model_dir(path, trust_remote_code, weights=False)
    except ModelDirError:
        path = Path(path)
        if (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
            return ModelDir(path, [], None, trust_remote_code)  # config.json alone: sizes come from the meta model
        raise


def meta_lora_model(cfg: Config, model_dir: ModelDir | None = None) -> nn.Module:
    """The model of ``cfg`` on the meta device with its LoRA injected, as a rank builds it before sharding."""
    model_dir = model_dir or model_dir_for_plan(cfg.model.path, cfg.model.trust_remote_code)
    model, _ = inject_lora(build_meta_model(model_dir, compute_dtype(cfg)), cfg.lora, cfg.train.seed)
    return model


def model_facts(cfg: Config, device: torch.device, seq_len: int | None = None, model: nn.Module | None = None) -> Facts:
    """The model's sizes, and what a micro-batch of rows of ``seq_len`` tokens (default --seq-len) saves
    for backward, traced on ``device`` for each micro-batch size and LoRA dtype when first asked for
    (``Facts.saved_for``). ``model``: ``meta_lora_model(cfg)``, when the caller has it."""
    model_dir = model_dir_for_plan(cfg.model.path, cfg.model.trust_remote_code)
    dtype = compute_dtype(cfg)
    model = model if model is not None else meta_lora_model(cfg, model_dir)
    base = model.get_base_model()
    params = _unique_params(model)
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    selected = quantize.select(model).quantized if cfg.model.quantize == "nf4" else {}
    nf4 = {id(m.weight) for m in selected.values()}
    frozen = sum(_nbytes(p, dtype, nf4) if id(p) in nf4 else p.numel() * p.element_size()
                 for p in params.values() if not p.requires_grad)
    largest_nf4 = max((m.weight for m in selected.values()), key=lambda w: w.numel(), default=None)
    layers = decoder_layers(model)
    in_layers = {i for layer in layers for i in _unique_params(layer)}
    embed, head, tied = embedding_tables(model)
    largest = max(layers, key=lambda layer: sum(p.numel() for p in layer.parameters()), default=None)
    heads = _heads(base.config)  # attention's shape: context parallelism's head shares, generation's KV cache
    facts = Facts(
        total_params=sum(p.numel() for p in params.values()), trainable_params=trainable,
        frozen_bytes=frozen, compute_itemsize=dtype.itemsize, dtype=dtype, layers=len(layers),
        block_bytes=sum(_nbytes(p, dtype, nf4) for p in largest.parameters()) if largest else 0,
        embed_bytes=sum(p.numel() for p in embed.parameters()) * dtype.itemsize if embed else 0,
        head_bytes=0 if tied or head is None else sum(p.numel() for p in head.parameters()) * dtype.itemsize,
        tables_by_rows=tables_by_rows(embed, head, tied),
        units_bytes=_units_bytes(largest, dtype, nf4) if largest else [],
        root_bytes=sum(p.numel() for i, p in params.items() if i not in in_layers) * dtype.itemsize,
        hidden=int(base.config.hidden_size),
        # without weights (config.json alone): what a checkpoint in the model dtype would hold
        checkpoint_bytes=checkpoint_bytes(model_dir) if model_dir.weight_files
        else sum(p.numel() for p in params.values() if not p.requires_grad) * dtype.itemsize,
        dequant_bytes=largest_nf4.numel() * dtype.itemsize if largest_nf4 is not None else 0,
        quantize_slice_bytes=largest_nf4.numel() * dtype.itemsize if largest_nf4 is not None else 0,
        nf4_bytes=sum(_nbytes(p, dtype, nf4) for i, p in params.items() if i in nf4),
        nf4_dequantized_bytes=sum(p.numel() for i, p in params.items() if i in nf4) * dtype.itemsize,
        nf4_layer_dequantized_bytes=max((sum(p.numel() for i, p in _unique_params(layer).items() if i in nf4)
                                         for layer in layers), default=0) * dtype.itemsize,
        chunked_head=head_transform(base, head)[0] is not None,
        **heads,
        kv_bytes_per_token=len(layers) * 2 * heads["kv_heads"] * heads["head_dim"] * dtype.itemsize,
    )
    facts.seq_len = seq_len or cfg.data.seq_len
    facts.trace = functools.partial(_trace, model, device)
    return facts


def _heads(config) -> dict[str, int]:
    """The attention heads of a transformers config (its text model's), 0 where it names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv = int(getattr(text, "num_key_value_heads", 0) or heads)
    dim = int(getattr(text, "head_dim", 0) or (text.hidden_size // heads if heads else 0))
    return {"heads": heads, "kv_heads": kv, "head_dim": dim}


#: the fake-tensor passes made in this process, by what decides them (``_traced_as``) and the micro-batch size,
#: LoRA weight dtype and row width: the same model is planned again by each command of a notebook or a test
#: session (``plan`` then ``finetune``, a budget tried after another), and each pass runs the model's whole forward
_TRACES: dict[tuple[str, int, torch.dtype, int], Saved] = {}


def _traced_as(model: nn.Module, device: torch.device) -> str:
    """What a fake-tensor pass of ``model`` on ``device`` depends on, as a digest: the model's class, its whole
    configuration (the attention implementation included), its modules (their kinds and settings: LoRA's rank,
    dropout, DoRA's magnitude, …) and every parameter's and buffer's shape, dtype and whether it trains."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    parts = [type(base).__module__, type(base).__qualname__, str(device), repr(model),
             config.to_json_string(use_diff=False) if config is not None else "",
             str(getattr(config, "_attn_implementation", None))]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in model.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in model.named_buffers()]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _trace(model: nn.Module, device: torch.device, micro_batch: int, lora_dtype: torch.dtype, seq_len: int) -> Saved:
    key = (_traced_as(model, device), micro_batch, lora_dtype, seq_len)
    if key not in _TRACES:
        _TRACES[key] = _saved_bytes(model, micro_batch, seq_len, lora_dtype, device)
    return _TRACES[key]
