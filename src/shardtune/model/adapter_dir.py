"""The one check of a peft adapter directory, wherever an adapter is read, and of the base it meets.

Every command that reads an adapter (merge, export, generate, eval, ``export --check vllm``,
``--init-adapter``) comes through ``check_adapter_dir``: config and weights there, headers and sizes
whole, at least one tensor, every value finite, and each LoRA pair's two halves of one rank, the
rank adapter_config.json gives. Where an adapter meets a base model (all of them but ``--check
vllm``), the base's fingerprint (model/fingerprint.py), which shardtune records in every adapter it
writes (the safetensors metadata key ``BASE_KEY``), must be the base's given: another model, of the
same shapes included, is refused; the same model under another name or path, or the same weights
under another config.json, is a warning; an
adapter that records none (peft's own, an older shardtune's) gets a one-line note.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from shardtune.config import ConfigError
from shardtune.errors import check_path
from shardtune.model.directory import ModelDir, check_safetensors, read_json
from shardtune.model.fingerprint import differences, model_fingerprint, same_weights

log = logging.getLogger("shardtune")

#: The adapter_model.safetensors metadata key holding the base model's fingerprint (JSON).
BASE_KEY = "shardtune.base_model"
_PAIR = re.compile(r"^(?P<module>.+)\.lora_(?:embedding_)?(?P<side>[AB])(?:\.weight)?$")
_PEFT_PREFIX = "base_model.model."
_said: set[str] = set()  # notes and warnings already given in this process


class AdapterDirError(ConfigError):
    """An adapter directory that is missing files, whose files are damaged, or that was made for another base."""


def base_metadata(fingerprint: dict | None) -> dict[str, str]:
    """The safetensors metadata an adapter made from a base of ``fingerprint`` carries (write_adapter)."""
    return {"format": "pt", **({BASE_KEY: json.dumps(fingerprint, sort_keys=True)} if fingerprint else {})}


def check_adapter_dir(path: str | Path, what: str = "adapter directory", base: ModelDir | None = None) -> dict:
    """Check the adapter at ``path`` (module doc) and, with ``base``, that it was made from that model.
    Returns its adapter_config.json; the error names the file and tensor."""
    path = check_path(path, what, "dir", error=AdapterDirError)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterDirError(f"{what} {path} has no adapter_config.json (fine-tunes write OUT_DIR/adapter)")
    config = read_json(config_file, AdapterDirError)
    weights = path / "adapter_model.safetensors"
    recorded = None
    if weights.is_file():
        header = check_safetensors(weights, AdapterDirError)
        if not any(name != "__metadata__" for name in header):
            raise AdapterDirError(f"{weights} holds no tensors: this adapter would change nothing (a save that "
                                  "failed, or a file not written by a fine-tune?); use a finished fine-tune's "
                                  "OUT_DIR/adapter, or `shardtune adapter-from-checkpoint` on one of its checkpoints")
        _check_ranks(weights, header, config, config_file)
        _check_finite(weights)
        recorded = _recorded_base(weights, header)
    elif not (path / "adapter_model.bin").is_file():
        raise AdapterDirError(f"{what} {path} has no adapter_model.safetensors")
    if base is not None:
        check_base(path, config, recorded, base)
    return config


def _recorded_base(weights: Path, header: dict) -> dict | None:
    text = (header.get("__metadata__") or {}).get(BASE_KEY)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise AdapterDirError(f"{weights}: its metadata {BASE_KEY} is not valid JSON (the file is damaged)") from None
    return value if isinstance(value, dict) else None


def check_base(path: Path, config: dict, recorded: dict | None, base: ModelDir) -> None:
    """Refuse an adapter made from another model than ``base``; warn when only the name differs."""
    name = config.get("base_model_name_or_path")
    if recorded is None:
        _say(f"note: adapter {path} does not record the base model it was trained on (peft's own adapters and "
             f"an older shardtune's do not): --model {base.path} is taken to be it")
        return
    now = model_fingerprint(base)
    other, _ = differences(recorded, now)
    if other and same_weights(recorded, now):  # config.json only: a LoRA update fits the same weights
        _say(f"adapter {path} was trained on a base whose weights are those of --model {base.path}, but {other}; "
             "it is taken as the same model with another config")
        return
    if other:
        raise AdapterDirError(f"adapter {path} was trained on another base model than --model {base.path}: {other}. "
                              f"Give the base it was trained on (its adapter_config.json names {name})")
    if name and not _names_it(str(name), base.path):
        _say(f"adapter {path} names {name} as its base, not --model {base.path}; their config, tensor shapes and "
             "sampled weights match, so it is taken as the same model under another name")


def _names_it(name: str, path: Path) -> bool:
    """Whether the adapter's base name ``name`` (a local path or a Hub id) names the model at ``path``."""
    if Path(name).expanduser().exists():
        return Path(name).expanduser().resolve() == path.resolve()
    repo = name.split("@", 1)[0]
    # a Hub model in the Hugging Face cache: .../models--ORG--NAME/snapshots/REVISION
    return any(part == "models--" + repo.replace("/", "--") for part in path.resolve().parts)


def _say(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning("%s", message)


def _check_ranks(weights: Path, header: dict, config: dict, config_file: Path) -> None:
    """Each LoRA pair complete, its halves of one rank (A: rank × in, B: out × rank), the rank the config
    gives (``r``, or its ``rank_pattern``): named here, not by torch's matmul or peft's load later."""
    halves: dict[str, dict[str, list[int]]] = {}
    for key, info in header.items():
        m = _PAIR.match(key) if key != "__metadata__" else None
        if m and isinstance(info, dict) and len(info.get("shape", ())) >= 2:
            halves.setdefault(m["module"], {})[m["side"]] = list(info["shape"])
    pattern = config.get("rank_pattern") or {}
    for module, sides in sorted(halves.items()):
        if set(sides) != {"A", "B"}:
            have = next(iter(sides))
            raise AdapterDirError(f"{weights}: {module} has lora_{have} but no lora_{'B' if have == 'A' else 'A'} "
                                  "(the file is damaged, or was edited)")
        a, b = sides["A"], sides["B"]
        if a[0] != b[1]:
            raise AdapterDirError(f"{weights}: {module}: lora_A has rank {a[0]} (shape {a}) but lora_B has rank {b[1]} "
                                  f"(shape {b}); the two halves of a LoRA pair share one rank (the file is damaged, or "
                                  "was edited)")
        want, where = config.get("r"), "r"
        if pattern:
            from peft.utils.other import get_pattern_key

            key = get_pattern_key(pattern.keys(), module.removeprefix(_PEFT_PREFIX))
            if key in pattern:
                want, where = pattern[key], f"rank_pattern {key!r}"
        if isinstance(want, int) and a[0] != want:
            raise AdapterDirError(f"{weights}: {module} has rank {a[0]}, but {config_file} gives {where} = {want}: the "
                                  "weights and the config are not of one adapter")


def _check_finite(weights: Path) -> None:
    """Every floating-point tensor of ``weights`` finite, read one tensor at a time (adapters are small)."""
    import torch
    from safetensors import SafetensorError, safe_open

    from shardtune.model.finite import all_finite

    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if not all_finite(tensor):
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise AdapterDirError(
                        f"{weights}: tensor {name} holds {bad} non-finite value(s) (NaN or inf) of {tensor.numel()}: "
                        "the training that wrote it diverged, and anything made from it would be garbage; use an "
                        "earlier checkpoint (`shardtune adapter-from-checkpoint`) or train again with a smaller --lr")
    except (SafetensorError, OSError) as err:
        raise AdapterDirError(f"{weights}: not a readable safetensors file ({err})") from None
