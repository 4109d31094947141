"""A base model's fingerprint: what a resumable checkpoint records of the model it was made from.

Cheap by design (config.json and the safetensors headers, never the weights' bytes), so that
``--resume`` against another model is refused before any worker loads a weight. It tells apart
models of another architecture or size (any config key, any tensor name or shape); it cannot tell
apart two trainings of one architecture, whose files differ only in their bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

from shardtune.model.directory import ModelDir
from shardtune.runtime.safetensors_header import read_header

# config.json keys that say how a file was written, not which model it holds: a copy re-saved by
# another transformers version or in another dtype is the same model.
_BOOKKEEPING = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "dtype", "torch_dtype",
                          "use_cache", "initializer_range"})
_SHOWN = 4  # differences named in one message


def model_fingerprint(model_dir: ModelDir) -> dict[str, Any]:
    """{"config": the model-defining keys of config.json, "tensors": how many, "shapes_sha256": of every
    tensor's name and shape, "dtypes": {safetensors dtype: tensors}}."""
    config = json.loads((model_dir.path / "config.json").read_text())
    tensors: dict[str, dict] = {}
    for file in model_dir.weight_files:
        tensors.update(read_header(file))
    shapes = "\n".join(f"{name} {info['shape']}" for name, info in sorted(tensors.items()))
    return {"config": {k: v for k, v in sorted(config.items()) if k not in _BOOKKEEPING},
            "tensors": len(tensors), "shapes_sha256": hashlib.sha256(shapes.encode()).hexdigest(),
            "dtypes": dict(sorted(Counter(info["dtype"] for info in tensors.values()).items()))}


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
    return other, stored


def _value(config: dict, key: str) -> str:
    return json.dumps(config[key]) if key in config else "(absent)"


def _dtypes(fingerprint: dict) -> str:
    return ", ".join(f"{dtype} ({n})" for dtype, n in (fingerprint.get("dtypes") or {}).items()) or "?"
