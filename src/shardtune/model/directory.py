"""The model directory a run points at: checked once, saying exactly what is missing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardtune.config import ConfigError


class ModelDirError(ConfigError):
    """The model directory is missing something a fine-tune needs."""


@dataclass
class ModelDir:
    path: Path
    weight_files: list[Path]
    index: dict | None

    @property
    def weight_names(self) -> set[str]:
        """Names of the tensors stored in the checkpoint (read from headers, not data)."""
        if self.index is not None:
            return set(self.index["weight_map"])
        from safetensors import safe_open

        names: set[str] = set()
        for file in self.weight_files:
            with safe_open(str(file), framework="pt") as f:
                names.update(f.keys())
        return names


def check_model_dir(path: str | Path) -> ModelDir:
    """Check a Hugging Face model directory and say exactly what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"model directory {path} has no config.json")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text())
            files = sorted({path / name for name in index["weight_map"].values()})
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelDirError(f"{index_file}: not a valid safetensors index ({err})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(f"{index_file} names weight files that are missing: {', '.join(missing)}")
        return ModelDir(path, files, index)
    if (path / "model.safetensors").is_file():
        return ModelDir(path, [path / "model.safetensors"], None)
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.gguf"))
    hint = f" (found {', '.join(others)}: convert to safetensors first)" if others else ""
    raise ModelDirError(
        f"model directory {path} has no model.safetensors or model.safetensors.index.json{hint}"
    )
