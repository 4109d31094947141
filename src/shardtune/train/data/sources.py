"""Data beyond our JSON Lines: what the ``datasets`` library loads, column mapping, ShareGPT records.

Sources read with ``datasets`` (an optional extra: ``pip install 'shardtune[datasets]'``):
  a directory written by ``Dataset.save_to_disk`` (a DatasetDict: its "train" split),
  ``.parquet``, ``.csv`` and ``.arrow`` files (and a folder of them), and a Hub dataset id
  (``org/name[@revision]``), resolved like a Hub model id (model/hub.py: the Hugging Face cache, then a
  download unless offline) to a local snapshot that ``datasets`` reads. ``.json``/``.jsonl`` files (gzip,
  bzip2 or xz compressed too) stay with read.py's reader, whose errors name the line, and so does a folder
  of them, read as ``datasets`` reads a data folder (``json_files``).
A null value is a field left out, from every source alike (a CSV's empty cell, a Parquet null, a JSON
``null``): ``"input": null`` is no input; a required field null is named as missing.
``--data-fields prompt=question,response=answer`` maps other column names onto the record shapes
(prompt/instruction, input, response/output, messages, text, conversations).
ShareGPT records ``{"conversations": [{"from": "human"|"gpt"|"system", "value": …}]}`` become chat
messages (loss on the assistant turns only).
"""

from __future__ import annotations

import re
from pathlib import Path

from shardtune.config import FIELDS, ConfigError
from shardtune.errors import plain_suffix
from shardtune.train.data.records import DataError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system"}
_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_SAVED = ("dataset_info.json", "state.json", "dataset_dict.json")  # what Dataset.save_to_disk writes
JSON_SUFFIXES = (".jsonl", ".json")
# datasets' split names in a data folder's file names (datasets.data_files): a word between separators
_SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                "test": ("test", "testing", "eval", "evaluation")}
_SEP = "[-._ 0-9]"


def is_datasets_source(path: str | Path) -> bool:
    """Whether ``path`` is read with ``datasets``: a saved dataset, a Parquet/CSV/Arrow file or a folder of
    them (no JSON in it), or a Hub name."""
    p = Path(path)
    if p.is_dir():
        return _saved(p) or (not json_files(p, every=True) and bool(_data_files(p, tuple(_FILE_BUILDERS))))
    if p.suffix.lower() in _FILE_BUILDERS:
        return True
    return is_hub_name(path)


def _saved(folder: Path) -> bool:
    return any((folder / f).is_file() for f in _SAVED)


def _data_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files of ``suffixes`` under ``folder``, hidden ones (``.x``, ``__x``) left out, as datasets does."""
    return sorted(f for f in folder.rglob("*") if f.is_file() and plain_suffix(f).lower() in suffixes
                  and not any(part.startswith((".", "__")) for part in f.relative_to(folder).parts))


def _split_of(file: Path, folder: Path) -> str | None:
    """The split ``file``'s name (or a folder above it) says, as datasets reads a data folder; None: none."""
    *dirs, name = file.relative_to(folder).parts
    for split, words in _SPLIT_WORDS.items():
        for word in words:
            if re.search(rf"(^|{_SEP}){word}{_SEP}", name) or any(
                    re.search(rf"(^|{_SEP}){word}({_SEP}|$)", d) for d in dirs):
                return split
    return None


def json_files(folder: Path, every: bool = False) -> list[Path]:
    """A plain folder's JSON Lines / JSON files as ``datasets`` takes its train split: those whose name (or
    folder) says train (train.jsonl, train-00000-of-00002.jsonl, data/train/x.jsonl) when any file names a
    split, else all of them; in name order. ``every``: all of them, whatever their names."""
    if _saved(folder):
        return []
    found = _data_files(folder, JSON_SUFFIXES)
    if every or not any(_split_of(f, folder) for f in found):
        return found
    train = [f for f in found if _split_of(f, folder) == "train"]
    if not train:
        raise DataError(f"{folder}: its files name other splits ({', '.join(f.name for f in found[:4])}) but none "
                        "the train split (train.jsonl, train-00000.jsonl, …): give the file to train on")
    return train


def is_hub_name(path: str | Path) -> bool:
    """Whether ``path`` is a Hub dataset id: no such local path, the form ``org/name``, no file suffix
    (so a mistyped ``data/train.jsonl`` is named as a missing file, not looked up on the Hub)."""
    from shardtune.model.hub import parse_hub_id

    p = Path(path).expanduser()
    return not p.exists() and p.suffix == "" and parse_hub_id(str(path)) is not None


def local_source(path: str | Path) -> Path:
    """Where a source's files are: ``path`` itself, or a Hub dataset id's snapshot in the Hugging Face
    cache (found there, or downloaded; model/hub.py raises HubDatasetError, saying why, when neither)."""
    from shardtune.model.hub import resolve_dataset

    return (resolve_dataset(str(path)) if is_hub_name(path) else None) or Path(path)


def location(path: str | Path, index: int) -> str:
    """How an error names a record: file:line for JSON Lines, 'record N' for datasets sources and folders."""
    return f"{path}, record {index}" if Path(path).is_dir() or is_datasets_source(path) else f"{path}:{index}"


def read_rows(path: str | Path) -> list[tuple[int, dict]]:
    """(record index from 1, row) pairs of a datasets source; None values (empty CSV cells) dropped."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{path}: reading this needs the datasets library: pip install 'shardtune[datasets]'") \
            from None
    datasets.disable_progress_bars()
    hub = is_hub_name(path)
    p = local_source(path)
    try:
        if hub:  # the snapshot's files, as datasets finds them (the card's splits, or train* files)
            ds = datasets.load_dataset(str(p), split="train")
        elif p.is_dir() and _saved(p):
            ds = datasets.load_from_disk(str(p))
        elif p.is_dir():  # a folder of Parquet/CSV/Arrow files: datasets takes its train split, as for a Hub snapshot
            ds = datasets.load_dataset(str(p), split="train")
        elif p.suffix.lower() in _FILE_BUILDERS:
            if not p.is_file():
                raise DataError(f"data file {p} does not exist")
            ds = datasets.load_dataset(_FILE_BUILDERS[p.suffix.lower()], data_files=str(p), split="train")
        else:
            raise DataError(f"{path}: not a data source datasets reads")
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; the user needs the file and reason
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{path}: datasets could not read it: {reason}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a dataset with splits {', '.join(ds)}; save or give one split (no 'train')")
        ds = ds["train"]
    if len(ds) == 0:
        raise DataError(f"{path}: no records")
    return [(i + 1, dict(row)) for i, row in enumerate(ds)]


def normalize(record: object, fields: dict[str, str], where: str) -> object:
    """Apply the column mapping, leave out null fields (module doc), then turn a ShareGPT record into chat
    messages."""
    if not isinstance(record, dict):
        return record  # the record form's check names the wrong type
    if fields:
        missing = [c for c in fields.values() if c not in record]
        if missing:
            raise DataError(f"{where}: no column {', '.join(repr(m) for m in missing)} (from --data-fields); "
                            f"found: {', '.join(sorted(record)) or 'none'}")
        mapped = {field: record[column] for field, column in fields.items()}
        record = {k: v for k, v in record.items() if k not in fields.values() and k not in FIELDS.values()} | mapped
    known = {*FIELDS.values(), "prompt"}
    nulls = sorted(k for k, v in record.items() if v is None and k in known)
    record = {k: v for k, v in record.items() if v is not None}
    if nulls and not known & record.keys():
        raise DataError(f"{where}: {', '.join(map(repr, nulls))} {'is' if len(nulls) == 1 else 'are'} null (a null "
                        "field counts as left out), and no other field makes a record")
    if "conversations" in record and "messages" not in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: 'conversations' must be a non-empty list")
        messages = []
        for i, turn in enumerate(turns):
            if not (isinstance(turn, dict) and isinstance(turn.get("value"), str)):
                raise DataError(f"{where}: conversations[{i}] must be an object with a string 'value'")
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise DataError(f"{where}: conversations[{i}].from is {turn.get('from')!r}; expected one of "
                                f"{', '.join(SHAREGPT_ROLES)}")
            messages.append({"role": role, "content": turn["value"]})
        record = {k: v for k, v in record.items() if k != "conversations"} | {"messages": messages}
    return record
