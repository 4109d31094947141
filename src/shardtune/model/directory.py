"""The model directory a run points at: checked once, saying exactly what is missing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.config import ConfigError
from shardtune.errors import check_path, read_text
from shardtune.runtime.safetensors_header import header_with_length


class ModelDirError(ConfigError):
    """The model directory is missing something a fine-tune needs."""


@dataclass
class ModelDir:
    path: Path
    weight_files: list[Path]
    index: dict | None
    trust_remote_code: bool = False  # the model's own code (config auto_map) may run: the user opted in
    #: {weight file name: safetensors header} for a Hub model whose weights were not downloaded (plan)
    remote_headers: dict[str, dict] = field(default_factory=dict)

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


def check_safetensors(file: Path, error: type[ConfigError] = ModelDirError) -> dict:
    """The header of safetensors ``file``, after checking that the file holds every byte it promises.

    A truncated file (an interrupted copy or download) otherwise passes every check and fails in the
    workers, with a traceback that names neither the file nor the tensor.
    """
    try:
        size = file.stat().st_size
        header, length = header_with_length(file)
    except OSError as err:
        raise error(f"cannot read {file}: {err.strerror or err}") from None
    except ValueError as err:
        raise error(str(err)) from None
    available = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = int(info["data_offsets"][1])
        except (TypeError, KeyError, IndexError, ValueError):
            raise error(f"{file}: tensor {name} has no valid data_offsets (the file is damaged)") from None
        if end > available:
            raise error(f"{file} is truncated: tensor {name} ends at byte {8 + length + end}, "
                        f"the file has {size} bytes")
    return header


def read_json(file: Path, error: type[ConfigError] = ModelDirError) -> dict:
    """A JSON object from ``file``, or ``error`` naming the file and the line."""
    check_path(file, "", "file", error=error)  # never opened when it is a FIFO or a device
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as err:
        raise error(f"cannot read {file}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise error(f"{file}: not valid UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise error(f"{file}:{err.lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(value, dict):
        raise error(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


#: files a tokenizer is built from; transformers 5.0 builds an empty 8-token tokenizer from none of them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tokenizer.tiktoken")


#: the tokenizer's text files: transformers decodes each as UTF-8, and names none when one is not
TOKENIZER_TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt")


def load_tokenizer(model_dir: ModelDir):
    """The model directory's tokenizer, or a ModelDirError naming the directory (or the file) and the reason."""
    from transformers import AutoTokenizer

    if not any((Path(model_dir.path) / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"model directory {model_dir.path} has no tokenizer: none of "
                            f"{', '.join(TOKENIZER_FILES)}")
    folder = Path(model_dir.path)
    for file in [*(folder / n for n in TOKENIZER_TEXT_FILES), *sorted(folder.glob("additional_chat_templates/*"))]:
        if file.is_file():
            read_text(file, "tokenizer file", ModelDirError)  # names the file, line and byte of bad UTF-8
    try:
        return AutoTokenizer.from_pretrained(model_dir.path, trust_remote_code=model_dir.trust_remote_code)
    except KeyError as err:  # a file of the wrong structure: transformers says only the key
        name = next((n for n in ("tokenizer.json", "tokenizer_config.json") if (Path(model_dir.path) / n).is_file()),
                    "tokenizer.json")
        raise ModelDirError(f"{Path(model_dir.path) / name}: not a tokenizer file of the expected structure "
                            f"(no key {err.args[0] if err.args else err!r} where one was expected)") from None
    except (OSError, ValueError, TypeError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(" :")
        raise ModelDirError(
            f"model directory {model_dir.path} has no usable tokenizer "
            f"(tokenizer.json, tokenizer_config.json): {reason}"
        ) from None


def read_config(model_dir: ModelDir | Path, trust_remote_code: bool | None = None):
    """transformers' config of the model, validated by transformers; its complaint names config.json."""
    from transformers import AutoConfig

    path = model_dir.path if isinstance(model_dir, ModelDir) else Path(model_dir)
    trust = model_dir.trust_remote_code if trust_remote_code is None else trust_remote_code
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust)
    except Exception as err:  # its validators raise their own classes (huggingface_hub's strict dataclasses)
        reason = " ".join(line.strip() for line in str(err).strip().splitlines()[:3]) or type(err).__name__
        raise ModelDirError(f"{path / 'config.json'}: transformers refuses this config: {reason}") from None


def check_model_dir(path: str | Path, trust_remote_code: bool = False, weights: bool = True) -> ModelDir:
    """Check a Hugging Face model directory (or Hub id, see hub.py) and say exactly what is missing.

    A model whose config or tokenizer names its own code (``auto_map``) is refused unless
    ``trust_remote_code``: that code would run in every worker. ``weights=False`` (the planner) lets a
    Hub model come with its safetensors headers only.
    """
    from shardtune.model.hub import resolve

    hub = resolve(str(path), weights=weights, remote_code=trust_remote_code)
    path = hub.path if hub else Path(path).expanduser()
    if not path.exists():
        raise ModelDirError(f"model directory {path} does not exist (a local path: no Hub look-up was made; "
                            f"relative paths start at the working directory, {Path.cwd()})")
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} is a file, not a directory")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"model directory {path} has no config.json")
    read_json(path / "config.json")
    _check_remote_code(path, trust_remote_code)
    read_config(path, trust_remote_code)  # transformers' own validation, before anything else reads it
    if hub and hub.remote_headers:
        return ModelDir(path, [], None, trust_remote_code, hub.remote_headers)
    found = _weights(path)
    found.trust_remote_code = trust_remote_code
    headers = {file.name: check_safetensors(file) for file in found.weight_files}  # truncated copies fail here
    if found.index is not None:
        _check_index(path, found.index, headers)
    return found


def _check_index(path: Path, index: dict, headers: dict[str, dict]) -> None:
    """Every tensor the index names is in the file it names: a wrong index otherwise loads, or merges,
    a model with tensors silently missing."""
    wrong = sorted(name for name, file in index["weight_map"].items() if name not in headers.get(file, {}))
    if wrong:
        listed = ", ".join(f"{n} (not in {index['weight_map'][n]})" for n in wrong[:6])
        raise ModelDirError(f"{path / 'model.safetensors.index.json'} places {len(wrong)} tensor(s) in files that do "
                            f"not hold them: {listed}{' …' if len(wrong) > 6 else ''}")


def _check_remote_code(path: Path, trust_remote_code: bool) -> None:
    for name in ("config.json", "tokenizer_config.json"):
        file = path / name
        try:
            auto_map = json.loads(file.read_text()).get("auto_map") if file.is_file() else None
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as err:
            raise ModelDirError(f"{file}: not valid JSON ({err})") from None
        if auto_map and not trust_remote_code:
            raise ModelDirError(
                f"{file} names the model's own Python code (auto_map: {', '.join(sorted(auto_map))}); "
                "it runs only with --trust-remote-code, which executes that code in every worker: read it first"
            )


def _weights(path: Path) -> ModelDir:
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
