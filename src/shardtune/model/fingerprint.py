"""A base model's fingerprint: what a resumable checkpoint and an adapter record of the model they were
made from (checkpoint.json; the adapter's safetensors metadata, model/adapter_dir.py).

Cheap by design (config.json, the safetensors headers and a few values of a few tensors, never the
weights whole), so that ``--resume`` or an adapter against another model is refused before any
weight is loaded. It tells apart models of another architecture or size (any config key, any tensor
name or shape) and two trainings of one architecture (a base and its instruct model: the sampled
values differ); a copy re-saved in another dtype is the same model (values compared at that dtype's
precision).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from shardtune.model.directory import ModelDir
from shardtune.runtime.safetensors_header import read_header

# config.json keys that say how a file was written, not which model it holds: a copy re-saved by
# another transformers version or in another dtype is the same model.
_BOOKKEEPING = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "dtype", "torch_dtype",
                          "use_cache", "initializer_range"})
_SHOWN = 4  # differences named in one message
_SAMPLED, _VALUES = 8, 16  # tensors sampled, spread over the model, and values read at the start of each
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def model_fingerprint(model_dir: ModelDir) -> dict[str, Any]:
    """{"config": the model-defining keys of config.json, "tensors": how many, "shapes_sha256": of every
    tensor's name and shape, "dtypes": {safetensors dtype: tensors}, "sample": {tensor: [its first
    values]} of a few floating-point tensors (none for a Hub model whose weights were not downloaded)}."""
    config = json.loads((model_dir.path / "config.json").read_text())
    tensors: dict[str, dict] = {}
    where: dict[str, Path] = {}
    for file in model_dir.weight_files:
        header = read_header(file)
        tensors.update(header)
        where.update(dict.fromkeys(header, file))
    shapes = "\n".join(f"{name} {info['shape']}" for name, info in sorted(tensors.items()))
    return {"config": {k: v for k, v in sorted(config.items()) if k not in _BOOKKEEPING},
            "tensors": len(tensors), "shapes_sha256": hashlib.sha256(shapes.encode()).hexdigest(),
            "dtypes": dict(sorted(Counter(info["dtype"] for info in tensors.values()).items())),
            "sample": _sample(tensors, where)}


def _sample(tensors: dict[str, dict], where: dict[str, Path]) -> dict[str, list[float]]:
    """The first values of up to ``_SAMPLED`` floating-point matrices spread over the model (by name), read
    straight from their files: a few hundred bytes that differ between any two trainings."""
    import torch

    from shardtune.runtime.safetensors_header import TORCH_DTYPES, header_with_length

    names = sorted(n for n, info in tensors.items() if info.get("dtype") in _FLOAT_BYTES and len(info["shape"]) >= 2)
    picked = sorted({names[i * (len(names) - 1) // max(1, _SAMPLED - 1)] for i in range(_SAMPLED)}) if names else []
    sample = {}
    for name in picked:
        info, file = tensors[name], where[name]
        count = min(_VALUES, math.prod(info["shape"]))
        _, length = header_with_length(file)
        with file.open("rb") as f:
            f.seek(8 + length + int(info["data_offsets"][0]))
            raw = f.read(count * _FLOAT_BYTES[info["dtype"]])
        if len(raw) == count * _FLOAT_BYTES[info["dtype"]]:
            values = torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[info["dtype"]]).float()
            sample[name] = [float(v) for v in values.tolist()]
    return sample


def differences(before: dict[str, Any], now: dict[str, Any]) -> tuple[str | None, str | None]:
    """(what makes ``now`` another model than ``before``, or None; what differs that keeps it the same
    model, or None): config keys and tensor shapes are the model, dtypes only how it is stored."""
    old, new = before.get("config", {}), now.get("config", {})
    keys = sorted(k for k in old.keys() | new.keys() if k not in _BOOKKEEPING and old.get(k) != new.get(k))
    other = None
    if keys:
        other = "its config.json " + "; ".join(f"{k} was {_value(old, k)}, now {_value(new, k)}" for k in keys[:_SHOWN])
        other += f" (and {len(keys) - _SHOWN} more keys)" if len(keys) > _SHOWN else ""
    elif (before.get("tensors"), before.get("shapes_sha256")) != (now.get("tensors"), now.get("shapes_sha256")):
        other = (f"its weights' tensor names or shapes differ (config.json is the same; {before.get('tensors')} "
                 f"tensors then, {now.get('tensors')} now)")
    stored = None
    if before.get("dtypes") != now.get("dtypes"):
        stored = f"its weights were stored as {_dtypes(before)}, now as {_dtypes(now)}"
    if other is None:
        other = _other_values(before.get("sample"), now.get("sample"), exact=stored is None)
    return other, stored


def same_weights(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether both fingerprints sampled their weights and the tensors' names, shapes and sampled values agree
    (config.json aside: a copy saved by another transformers version, or with a changed rope setting)."""
    same_dtypes = before.get("dtypes") == now.get("dtypes")
    return bool(before.get("sample") and now.get("sample")) and \
        before.get("shapes_sha256") == now.get("shapes_sha256") and \
        _other_values(before["sample"], now["sample"], exact=same_dtypes) is None


def _other_values(before: dict | None, now: dict | None, exact: bool) -> str | None:
    """Why the sampled values say another training (None: the same, or one of the two has no sample).
    ``exact``: stored in the same dtypes, so equal to the bit; else equal at bf16's precision, the
    coarsest a copy may have been re-saved in."""
    if not before or not now:  # recorded before fingerprints sampled values, or a Hub model's headers only
        return None
    for name in sorted(before.keys() & now.keys()):
        old, new = before[name], now[name]
        if exact:
            same = old == new
        else:
            same = len(old) == len(new) and all(math.isclose(a, b, rel_tol=2**-7, abs_tol=1e-6)
                                                for a, b in zip(old, new))
        if not same:
            return (f"its weights differ: {name} starts {_short(old)}, now {_short(new)} (config.json and every "
                    "tensor's shape are the same: another training of this architecture, e.g. a base model "
                    "and its instruct version)")
    return None


def _short(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values[:3]) + ", …]"


def _value(config: dict, key: str) -> str:
    return json.dumps(config[key]) if key in config else "(absent)"


def _dtypes(fingerprint: dict) -> str:
    return ", ".join(f"{dtype} ({n})" for dtype, n in (fingerprint.get("dtypes") or {}).items()) or "?"
