"""``--model`` and ``--data`` as Hugging Face Hub ids (``org/name`` or ``org/name@revision``), resolved to a
local directory.

Order: an existing local path always wins; then the local Hugging Face cache (``HF_HOME`` /
``HF_HUB_CACHE``, the layout huggingface_hub writes); then, when online, a download of only what a
fine-tune reads: config, tokenizer and safetensors files (never ``*.bin``, GGUF or other formats;
``HF_TOKEN`` is used for gated models as huggingface_hub does). Offline (``HF_HUB_OFFLINE=1``) a
model missing from the cache is an error that says so. The planner asks for ``weights=False``: then
only the config is fetched and the safetensors headers are read over HTTP, never the weights.
A dataset id (``resolve_dataset``) follows the same order; its download is the data files ``datasets``
reads and the dataset card (whose YAML may name the splits), and ``HF_DATASETS_OFFLINE`` counts as
offline too. A miss always says both: no such local path, and why the Hub (or its cache) had nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.config import ConfigError

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")

#: Everything a run reads besides the weights: config, generation config, tokenizer, weight index.
META_PATTERNS = [
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "*.tiktoken", "vocab.json", "vocab.txt", "merges.txt", "chat_template.json",
    "chat_template.jinja",
]


#: What a dataset download fetches: the files ``datasets`` can read, and the card naming the splits.
DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json", ".csv")
DATA_PATTERNS = ["README.md", *(f"*{suffix}" for suffix in DATA_SUFFIXES)]


class HubModelError(ConfigError):
    """A Hub model id that cannot be resolved: not cached while offline, not found, gated, ..."""


class HubDatasetError(ConfigError):
    """A Hub dataset id that cannot be resolved, for the same reasons."""


@dataclass
class HubModel:
    """A Hub id resolved to a local snapshot directory."""

    repo_id: str
    revision: str | None
    path: Path
    #: {weight file name: safetensors header} when the weights were not downloaded (the planner's case)
    remote_headers: dict[str, dict] = field(default_factory=dict)


def base_model_name(spec: str) -> str:
    """What adapter_config.json records as the base model: a Hub id as given, a local path made absolute."""
    local = Path(spec).expanduser()
    return spec if not local.exists() and parse_hub_id(spec) else str(local.resolve())


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``spec`` reads as a Hub id, else None (then it is a local path)."""
    if spec.startswith((".", "/", "~")) or "\\" in spec:
        return None
    match = _HUB_ID.match(spec)
    return (match["repo"], match["revision"]) if match else None


def _not_local(spec: str, what: str = "directory") -> str:
    return f"there is no local {what} {spec} (paths are relative to the working directory, {Path.cwd()})"


def _not_cached(kind: str, spec: str, local: str, error: type[ConfigError], offline_var: str) -> ConfigError:
    from huggingface_hub import constants

    return error(f"{kind} '{spec}': {_not_local(spec, local)}, and as a Hub id it is not in the local Hugging Face "
                 f"cache ({constants.HF_HUB_CACHE}) and {offline_var} is set: download it while online (or unset "
                 f"{offline_var}), or give a local {local}")


@contextlib.contextmanager
def _hub_errors(kind: str, spec: str, local: str, error: type[ConfigError]) -> Iterator[None]:
    """The Hub's refusals while fetching ``kind`` ("model", "dataset") ``spec``, each as one message."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, revision = parse_hub_id(spec) or (spec, None)
    try:
        yield
    except GatedRepoError:
        raise error(
            f"{kind} '{spec}' is gated: accept its terms on huggingface.co and set HF_TOKEN (or `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise error(f"{kind} '{repo_id}' has no revision '{revision}' on the Hub") from None
    except RepositoryNotFoundError:
        raise error(f"{kind} '{spec}': {_not_local(spec, local)}, and no Hub {kind} repository has that name "
                    "(private ones need HF_TOKEN)") from None
    except (LocalEntryNotFoundError, OSError) as err:
        raise error(f"{kind} '{spec}': {_not_local(spec, local)}, and as a Hub id it could not be downloaded from "
                    f"the Hugging Face Hub ({err})") from None


def _hub_id_not_local(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``spec`` is no local path and reads as a Hub id; else None."""
    if Path(spec).expanduser().exists():
        return None
    return parse_hub_id(spec)


def resolve(spec: str, weights: bool = True, remote_code: bool = False) -> HubModel | None:
    """The local directory for Hub id ``spec`` (cache first, then download); None when ``spec`` is a local path.

    ``weights=False`` fetches only config, tokenizer and index files and reads the safetensors headers
    remotely. ``remote_code`` also fetches the repository's ``*.py`` files (trust_remote_code opted in).
    """
    parsed = _hub_id_not_local(spec)
    if parsed is None:
        return None
    repo_id, revision = parsed
    from huggingface_hub import is_offline_mode, snapshot_download

    extra = ["*.py"] if remote_code else []
    cached = _cached_snapshot(repo_id, revision, weights)
    if cached is not None:
        return HubModel(repo_id, revision, cached)
    if is_offline_mode():
        raise _not_cached("model", spec, "directory", HubModelError, "HF_HUB_OFFLINE")
    with _hub_errors("model", spec, "directory", HubModelError):
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=META_PATTERNS + extra))
        headers: dict[str, dict] = {}
        wanted = _weight_files(path)
        if weights:
            if wanted:
                snapshot_download(repo_id, revision=revision, allow_patterns=wanted)
        else:
            headers = _remote_headers(repo_id, revision)
    if not wanted and weights:
        raise HubModelError(f"model '{spec}' on the Hub has no safetensors weights (model.safetensors or an index)")
    return HubModel(repo_id, revision, path, headers)


def _weight_files(path: Path) -> list[str]:
    """The safetensors files a snapshot's index names, or model.safetensors when it has no index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise HubModelError(f"{index}: not a valid safetensors index") from None
    return ["model.safetensors"]


def _cached_snapshot(repo_id: str, revision: str | None, weights: bool) -> Path | None:
    """The cached snapshot when it holds config.json and (if ``weights``) every weight file."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    if not (path / "config.json").is_file():
        return None
    if weights and not all((path / name).is_file() for name in _weight_files(path)):
        return None
    if not weights and not any(path.glob("*.safetensors")):
        return None  # headers are read from local files; without them they come over HTTP
    return path


def _remote_headers(repo_id: str, revision: str | None) -> dict[str, dict]:
    """{file: safetensors header} read with HTTP range requests: the weights are never downloaded."""
    from huggingface_hub import get_safetensors_metadata

    meta = get_safetensors_metadata(repo_id, revision=revision)
    return {
        name: {key: {"dtype": info.dtype, "shape": info.shape, "data_offsets": list(info.data_offsets)}
               for key, info in file_meta.tensors.items()}
        for name, file_meta in meta.files_metadata.items()
    }


def resolve_dataset(spec: str) -> Path | None:
    """The local snapshot of Hub dataset id ``spec`` (cache first, then a download of its data files and
    card); None when ``spec`` exists locally or does not read as a Hub id."""
    parsed = _hub_id_not_local(spec)
    if parsed is None:
        return None
    repo_id, revision = parsed
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        cached = Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        cached = None
    if cached is not None and _has_data(cached):
        return cached
    datasets_offline = os.environ.get("HF_DATASETS_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    if is_offline_mode() or datasets_offline:
        offline_var = "HF_HUB_OFFLINE" if is_offline_mode() else "HF_DATASETS_OFFLINE"
        raise _not_cached("dataset", spec, "file or directory", HubDatasetError, offline_var)
    with _hub_errors("dataset", spec, "file or directory", HubDatasetError):
        path = Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, allow_patterns=DATA_PATTERNS))
    if not _has_data(path):
        raise HubDatasetError(f"dataset '{spec}' on the Hub has no data file shardtune reads "
                              f"({', '.join(DATA_SUFFIXES)})")
    return path


def _has_data(snapshot: Path) -> bool:
    return any(f.suffix in DATA_SUFFIXES and f.is_file() for f in snapshot.rglob("*"))
