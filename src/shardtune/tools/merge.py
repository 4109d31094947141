"""Fold a LoRA adapter into the base weights, streaming: one base tensor in memory at a time.

The output is a Hugging Face directory with the input's weight files under the same names and the
same ``weight_map``; config.json, generation_config.json and the tokenizer files are copied. Each
output file's safetensors header is known before any data is read (shapes and dtypes do not change),
so it is written first and the tensors follow one by one: the merged model is never whole in memory.

What peft's ``merge_and_unload`` would do, per adapter tensor:
  LoRA pair on a linear layer     W += scale · B @ A      (transposed for GPT-2's Conv1D: fan_in_fan_out)
  LoRA pair on an embedding       W += scale · (B @ A)ᵀ
  ``lora_B.bias`` (lora_bias)     b += scale · lora_B.bias
  DoRA magnitude m (use_dora)     W ← m / ‖W + ΔW‖ · (W + ΔW), the norm per output row (peft's merge)
  anything else                   replaces the base tensor (modules_to_save, biases with bias="all"/"lora_only")
with scale = alpha / r, or alpha / √r under rslora, and rank_pattern / alpha_pattern honoured.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardtune.errors import ShardtuneError
from shardtune.model.adapter_dir import check_adapter_dir
from shardtune.model.checkpoint_keys import checkpoint_key
from shardtune.model.directory import ModelDir, check_model_dir
from shardtune.model.finite import all_finite
from shardtune.model.lora import PEFT_PREFIX
from shardtune.model.meta import DTYPES
from shardtune.runtime.cpu_tuning import tune_malloc
from shardtune.runtime.failure import stage
from shardtune.runtime.files import staged_dir
from shardtune.runtime.outputs import check_output, claim_output
from shardtune.runtime.progress import Bar, progress
from shardtune.runtime.safetensors_header import TORCH_DTYPES, encode_header
from shardtune.runtime.versions import tied_weights_keys
from shardtune.train.run_folder import adapter_run_options

log = logging.getLogger("shardtune")

_LORA = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_(?:embedding_)?[AB])\.(?P<what>weight|bias)$")
_DORA = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.weight)?$")
# Weights in other formats are not carried over: the output's weights are its safetensors files.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


class MergeError(ShardtuneError, ValueError):
    """The adapter cannot be merged into this model; the message says which tensor and why."""


@dataclass
class Change:
    """What the adapter does to one base tensor."""

    replacement: torch.Tensor | None = None
    # (A-side, B-side, scale): W += scale · left @ right
    products: list[tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=list)
    bias: torch.Tensor | None = None  # added as is (already scaled)
    # DoRA: each output row is rescaled to this norm after the products; dim 1 of the stored weight is
    # the input dimension, or dim 0 for GPT-2's Conv1D (stored transposed).
    magnitude: torch.Tensor | None = None
    norm_dim: int = 1


def read_adapter(adapter: Path, base: ModelDir | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter's config and tensors, checked (model/adapter_dir.py), against ``base`` when given."""
    from safetensors.torch import load_file

    config_file, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    config = check_adapter_dir(adapter, base=base)
    if not weights.is_file():
        raise MergeError(f"adapter directory {adapter} has no {weights.name}")
    if config.get("peft_type", "LORA") != "LORA":
        raise MergeError(f"{config_file}: peft_type {config['peft_type']!r}; only LoRA adapters can be merged")
    return config, load_file(str(weights))


def changes_of(config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, Change]:
    """{base tensor name (as the model names it): Change} for every tensor of the adapter."""
    from peft.utils.other import get_pattern_key

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    changes: dict[str, Change] = {}
    for key, value in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        m = _LORA.match(name)
        dora = _DORA.match(name)
        if dora:
            pairs.setdefault(dora["module"], {})["magnitude"] = value.float()
        elif m:
            pairs.setdefault(m["module"], {})[f"{m['kind']}.{m['what']}"] = value.float()
        elif "lora_" in name:
            raise MergeError(f"adapter tensor {key}: a LoRA variant this merge does not know")
        else:
            changes.setdefault(checkpoint_key(name), Change()).replacement = value
    for module, parts in pairs.items():
        if set(parts) == {"magnitude"}:
            raise MergeError(f"adapter module {module}: a DoRA magnitude without its LoRA matrices")
        embedding = "lora_embedding_A.weight" in parts
        a = parts.get("lora_embedding_A.weight" if embedding else "lora_A.weight")
        b = parts.get("lora_embedding_B.weight" if embedding else "lora_B.weight")
        if a is None or b is None:
            raise MergeError(f"adapter module {module}: has only one of its two LoRA matrices")
        r = a.shape[0]
        alpha = config.get("alpha_pattern", {}).get(
            get_pattern_key(config.get("alpha_pattern", {}).keys(), module), config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        # W (out × in) += scale · B @ A; stored transposed (in × out) for Conv1D and embeddings.
        transposed = embedding or config.get("fan_in_fan_out", False)
        product = (a.T, b.T, scale) if transposed else (b, a, scale)
        base = checkpoint_key(module)
        changes.setdefault(f"{base}.weight", Change()).products.append(product)
        if "lora_B.bias" in parts:
            changes.setdefault(f"{base}.bias", Change()).bias = parts["lora_B.bias"] * scale
        if "magnitude" in parts:
            if embedding:
                raise MergeError(f"adapter module {module}: DoRA on an embedding is not supported by this merge")
            change = changes[f"{base}.weight"]
            change.magnitude, change.norm_dim = parts["magnitude"], 0 if transposed else 1
    return changes


def apply(name: str, weight: torch.Tensor, change: Change) -> torch.Tensor:
    """The merged tensor, computed in fp32; in-place updates keep it to about one copy of ``weight``."""
    if change.replacement is not None:
        if change.replacement.shape != weight.shape:
            raise MergeError(f"{name}: the adapter's tensor has shape {list(change.replacement.shape)}, "
                             f"the model's {list(weight.shape)}")
        weight = change.replacement
    if not change.products and change.bias is None:
        return weight
    merged = weight.float() if weight.dtype != torch.float32 else weight.clone()
    for left, right, scale in change.products:
        if (left.shape[0], right.shape[1]) != tuple(merged.shape):
            raise MergeError(f"{name}: LoRA update of shape {[left.shape[0], right.shape[1]]} "
                             f"does not fit the weight of shape {list(merged.shape)}")
        merged.addmm_(left, right, alpha=scale)  # no temporary of the weight's size
    if change.magnitude is not None:
        norms = torch.linalg.norm(merged, dim=change.norm_dim, keepdim=True)
        merged *= change.magnitude.view_as(norms) / norms
    if change.bias is not None:
        merged += change.bias
    return merged


# A vision-language checkpoint in the layout transformers 4 saved (and transformers 5 still saves, renaming
# on load): the model's own prefix first, the checkpoint's second.
_VLM_STORED = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


def _stored_spellings(name: str) -> list[str]:
    """How a checkpoint may store the model's parameter ``name``: as is; GPT-2 hub files store "h.0…" for
    "transformer.h.0…"; a vision-language checkpoint "language_model.model.…" for "model.language_model.…"."""
    return [name, name.split(".", 1)[-1]] + [stored + name[len(own):] for own, stored in _VLM_STORED
                                             if name.startswith(own)]


def _resolve(changes: dict[str, Change], stored: dict[str, str], tied: dict[str, str]) -> dict[str, Change]:
    """Changes keyed by the checkpoint's own names (``_stored_spellings``)."""
    out: dict[str, Change] = {}
    for name, change in changes.items():
        key = next((k for k in _stored_spellings(name) if k in stored), name if name in tied else None)
        if key is None:
            raise MergeError(f"the adapter changes {name}, which the model's checkpoint does not have")
        out[key] = change
    return out


def _tied_sources(model_dir: ModelDir) -> dict[str, str]:
    """{tied parameter: the parameter stored in its place}, from the model class (built on meta)."""
    from shardtune.model.meta import build_meta_model

    model = build_meta_model(model_dir, torch.float32)
    return tied_weights_keys(model)


def _out_dtype(dtype: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    return wanted if wanted is not None and dtype.is_floating_point else dtype


def merge_file(src: Path, dst: Path, sources: MergeSources, dtype: torch.dtype | None,
               bar: Bar | None = None) -> tuple[int, int]:
    """Write ``dst``: every tensor of ``src``, merged, plus the tied copies ``sources`` places in it.

    Returns (bytes written, the largest tensor's bytes).
    """
    from safetensors import safe_open

    changes = sources.changes
    with safe_open(str(src), framework="pt") as f, open(dst, "wb") as out:
        names = sources.names_in(src.name, list(f.keys()))
        entries = []
        for name, source in names:
            piece = f.get_slice(source)  # the header only: no data is read here
            stored = TORCH_DTYPES[piece.get_dtype()]
            entries.append((name, _out_dtype(stored, dtype), list(piece.get_shape())))
        out.write(encode_header(entries, f.metadata()))
        written, largest = 0, 0
        for (name, tensor), (_, out_dtype, _) in zip(merged_tensors(f, names, changes), entries):
            tensor = tensor.to(out_dtype).contiguous()
            if name in changes and out_dtype != torch.float32:
                check_finite(name, tensor, f"in {str(out_dtype).removeprefix('torch.')}, the dtype it is stored in: "
                                           "the merged values do not fit it (`--dtype fp32` writes them in fp32)")
            out.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            written += tensor.nbytes
            largest = max(largest, tensor.nbytes)
            del tensor
            if bar is not None:
                bar.advance()
    return written, largest


def merged_tensors(f, names: list[tuple[str, str]], changes: dict[str, Change]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, merged tensor) for each (name, stored source) of the open safetensors file ``f``, one at a time.

    A tensor the adapter changes is checked finite here (merge and export both come through): nothing
    non-finite is ever written, and the error names the tensor."""
    for name, source in names:
        tensor = f.get_tensor(source)
        if name in changes:
            tensor = apply(name, tensor, changes[name])
            check_finite(name, tensor, "once the adapter's update is added (in fp32): the adapter's values are far "
                                       "too large (a run whose --lr blew the weights up?)")
        yield name, tensor


def check_finite(name: str, tensor: torch.Tensor, why: str) -> None:
    """Refuse a merged tensor holding NaN or inf: ``why`` says how it got there."""
    if not all_finite(tensor):
        bad = int((~torch.isfinite(tensor)).sum())
        raise MergeError(f"{name}: {bad} of its {tensor.numel()} values are not finite {why}; nothing was written")


@dataclass
class MergeSources:
    """Where every merged tensor comes from: what ``merge`` writes, and what ``export`` streams."""

    changes: dict[str, Change]  # keyed by the checkpoint's own tensor names
    file_of: dict[str, str]  # tensor name -> weight file name (in the model directory), tied copies included
    extra: dict[str, str]  # a tied weight the adapter changes: {its own name: the stored tensor it starts from}

    def names_in(self, file_name: str, stored: list[str]) -> list[tuple[str, str]]:
        """(name, source) pairs of one weight file: its ``stored`` tensors, then its tied copies."""
        return [(n, n) for n in stored] + [(n, s) for n, s in self.extra.items() if self.file_of[s] == file_name]


def merge_sources(model_dir: ModelDir, adapter: Path) -> MergeSources:
    """Read the adapter and resolve each of its changes to a tensor of ``model_dir``'s checkpoint."""
    config, tensors = read_adapter(adapter, model_dir)
    file_of = dict(model_dir.index["weight_map"]) if model_dir.index else {}
    if not file_of:
        from safetensors import safe_open

        with safe_open(str(model_dir.weight_files[0]), framework="pt") as f:
            file_of = {k: model_dir.weight_files[0].name for k in f.keys()}
    changes = changes_of(config, tensors)
    unstored = [n for n in changes if not any(k in file_of for k in _stored_spellings(n))]
    tied = _tied_sources(model_dir) if unstored else {}
    changes = _resolve(changes, file_of, tied)
    # A tied weight the adapter changes gets a tensor of its own, next to the one it was tied to.
    extra = {name: tied[name] for name in changes if name not in file_of}
    for name, source in extra.items():
        file_of[name] = file_of[source]
    return MergeSources(changes, file_of, extra)



def merge(model: str | Path, adapter: str | Path, out: str | Path, dtype: str = "auto",
          overwrite: bool = False, trust_remote_code: bool = False) -> dict:
    """Write ``out``: the model with the adapter folded in. Returns sizes: total and largest tensor bytes.

    A non-empty ``out`` is replaced only with ``overwrite=True``, and never when it is (or holds) an input.
    ``trust_remote_code``: a model that names its own code (config ``auto_map``) may run it (its class
    is built on meta to find tied weights).
    """
    inputs = (("model directory", model), ("adapter", adapter))
    check_output(out, kind="dir", inputs=inputs, overwrite=overwrite, name="output directory")
    model_dir = check_model_dir(model, trust_remote_code)
    sources = merge_sources(model_dir, Path(adapter))
    wanted = None if dtype == "auto" else DTYPES[dtype]
    changes, file_of, extra = sources.changes, sources.file_of, sources.extra
    # Each merged tensor is a fresh copy: with malloc's threshold fixed (runtime/cpu_tuning.py), freeing it gives
    # it back to the system at once, where glibc's moving threshold would leave the heap grown by it.
    tune_malloc()

    with claim_output(out, kind="dir", command="merge", inputs=inputs, overwrite=overwrite,
                      name="output directory") as out, staged_dir(out) as tmp, stage("write"), \
            progress("merge", len(file_of), unit="tensor") as bar:
        total, largest = 0, 0
        for src in model_dir.weight_files:
            written, big = merge_file(src, tmp / src.name, sources, wanted, bar)
            total, largest = total + written, max(largest, big)
        _copy_other_files(model_dir.path, tmp, wanted, untie=bool(extra))
        if model_dir.index:
            index = {**model_dir.index, "weight_map": dict(sorted(file_of.items()))}
            index["metadata"] = {**index.get("metadata", {}), "total_size": total}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    log.info("merged %s into %s: %d tensors changed, %.1f MiB written", adapter, out, len(changes), total / 2**20)
    if adapter_run_options(adapter).get("quantize") == "nf4":
        log.info("the adapter was trained on the 4-bit NF4 base (--quantize nf4) and is folded into the original "
                 "weights, as QLoRA usually is: outputs differ from the quantized model's by about the quantization "
                 "error (`shardtune eval --quantize nf4 --adapter …` reproduces the training-time base instead)")
    return {"out": str(out), "bytes": total, "largest_tensor_bytes": largest, "changed": len(changes),
            "dtypes": sorted(written_dtypes(model_dir, wanted))}


def written_dtypes(model_dir: ModelDir, wanted: torch.dtype | None) -> set[str]:
    """The floating-point dtypes the merged files hold (from the input headers: nothing is read)."""
    from safetensors import safe_open

    found = set()
    for file in model_dir.weight_files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                stored = TORCH_DTYPES[f.get_slice(key).get_dtype()]
                if stored.is_floating_point:
                    found.add(str(_out_dtype(stored, wanted)).removeprefix("torch."))
    return found


def _copy_other_files(src: Path, dst: Path, dtype: torch.dtype | None, untie: bool) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_NOT_COPIED) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    if dtype is None and not untie:
        return
    config_file = dst / "config.json"
    config = json.loads(config_file.read_text())
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in config:  # the name before transformers 5
            config["torch_dtype"] = config["dtype"]
    if untie:
        config["tie_word_embeddings"] = False
    config_file.write_text(json.dumps(config, indent=2) + "\n")
