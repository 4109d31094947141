"""Which checkpoint tensor each parameter reads: its name without peft's wrappers, its aliases (tied
weights, a Hub file without the model's prefix), and the headers checked against the model before any
weight is read (preflight) or loaded (loading.py)."""

from __future__ import annotations

from torch import nn

from shardtune.model import nf4_fill
from shardtune.model.directory import ModelDir, ModelDirError
from shardtune.model.lora import PEFT_PREFIX
from shardtune.model.structure import base_model
from shardtune.runtime.versions import tied_weights_keys

_WRAPPER_PARTS = (".base_layer", ".original_module", ".modules_to_save.default")


def checkpoint_key(param_name: str) -> str:
    """The name a base parameter has in the Hugging Face checkpoint, from its peft name."""
    name = param_name.removeprefix(PEFT_PREFIX)
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _aliases(base: nn.Module) -> dict[str, list[str]]:
    """Every name a parameter goes by (tied weights have several), keyed by its first name."""
    by_id: dict[int, list[str]] = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _find_in_checkpoint(names: list[str], stored: set[str], prefix: str) -> str | None:
    for name in names:
        key = checkpoint_key(name)
        candidates = [key]
        if prefix and key.startswith(prefix + "."):
            candidates.append(key[len(prefix) + 1:])  # e.g. GPT-2 Hub files store "h.0…", not "transformer.h.0…"
        for c in candidates:
            if c in stored:
                return c
    return None


def map_checkpoint_keys(model: nn.Module, names: list[str], stored: set[str]) -> tuple[dict[str, str], list[str],
                                                                                    set[str]]:
    """({peft parameter name: checkpoint key}, base names without a key, every checkpoint key used)."""
    base = base_model(model)
    prefix = getattr(base, "base_model_prefix", "")
    aliases = _aliases(base)
    # A tied weight may be stored under its partner's name only. Its names are aliases already, except
    # for copies that are no longer tied: peft's trainable copy of a tied lm_head (modules_to_save).
    for target, source in tied_weights_keys(base).items():
        aliases.setdefault(target, [target]).append(source)
        aliases.setdefault(source, [source]).append(target)
    found: dict[str, str] = {}
    missing: list[str] = []
    used: set[str] = set()
    for name in names:
        base_name = checkpoint_key(name)
        key = _find_in_checkpoint(aliases.get(base_name, [base_name]), stored, prefix)
        if key is None:
            missing.append(base_name)
            continue
        found[name] = key
        # a tied weight stored under both of its names uses both
        used.update(k for a in aliases.get(base_name, []) if (k := checkpoint_key(a)) in stored)
        used.add(key)
    return found, missing, used


def missing_error(model_dir: ModelDir, missing: list[str]) -> ModelDirError:
    return ModelDirError(
        f"{model_dir.path}: the checkpoint has no tensor for {len(missing)} parameter(s) of the model "
        f"built from config.json: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}"
    )


def check_against_headers(model: nn.Module, model_dir: ModelDir) -> None:
    """Before any worker starts: every base parameter of the (meta) model has a tensor in the safetensors
    headers, of the shape config.json gives and of a floating-point dtype (an integer tensor would be
    cast and trained on as if it were a weight). Reads headers only."""
    from shardtune.runtime.safetensors_header import read_header

    if not model_dir.weight_files:
        return  # a Hub model known by its remote headers only (plan): checked when it is downloaded
    headers = {}
    for file in model_dir.weight_files:
        headers.update({name: (file, info) for name, info in read_header(file).items()})
    params = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    found, missing, _ = map_checkpoint_keys(model, list(params), set(headers))
    if missing:
        raise missing_error(model_dir, missing)
    for name, key in found.items():
        file, info = headers[key]
        if str(info.get("dtype", "")).startswith(("I", "U", "BOOL")):
            raise ModelDirError(f"{file}: tensor {key} is stored as {info['dtype']} (integers), but it is the weight "
                                f"{checkpoint_key(name)} of a floating-point model: the file is not a plain "
                                "checkpoint of this model (quantized with another tool, or damaged)")
        shape, wanted = list(info.get("shape", [])), list(params[name].shape)
        if shape != wanted and not nf4_fill.is_nf4(params[name]):
            raise ModelDirError(f"{file}: tensor {key} has shape {shape}, but config.json gives {wanted}")
