"""Data beyond our JSON Lines: what the ``datasets`` library loads, column mapping, ShareGPT records.

Sources read with ``datasets`` (an optional extra: ``pip install 'shardtune[datasets]'``):
  a directory written by ``Dataset.save_to_disk`` (a DatasetDict: its "train" split),
  ``.parquet``, ``.csv`` and ``.arrow`` files, and a Hub dataset id (``org/name[@revision]``), resolved
  like a Hub model id (model/hub.py: the Hugging Face cache, then a download unless offline) to a local
  snapshot that ``datasets`` reads. ``.json``/``.jsonl`` files stay with read.py's reader, whose errors
  name the line.
``--data-fields prompt=question,response=answer`` maps other column names onto the record shapes
(prompt/instruction, input, response/output, messages, text, conversations).
ShareGPT records ``{"conversations": [{"from": "human"|"gpt"|"system", "value": …}]}`` become chat
messages (loss on the assistant turns only).
"""

from __future__ import annotations

from pathlib import Path

from shardtune.config import FIELDS, ConfigError
from shardtune.train.data.records import DataError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system"}
_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def is_datasets_source(path: str | Path) -> bool:
    """Whether ``path`` is read with ``datasets``: a saved dataset, a Parquet/CSV/Arrow file, or a Hub name."""
    p = Path(path)
    if p.is_dir():
        return any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))
    if p.suffix.lower() in _FILE_BUILDERS:
        return True
    return is_hub_name(path)


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
    """How an error names a record: file:line for JSON Lines, 'record N' for datasets sources."""
    return f"{path}, record {index}" if is_datasets_source(path) else f"{path}:{index}"


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
        elif p.is_dir():
            ds = datasets.load_from_disk(str(p))
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
    return [(i + 1, {k: v for k, v in row.items() if v is not None}) for i, row in enumerate(ds)]


def normalize(record: object, fields: dict[str, str], where: str) -> object:
    """Apply the column mapping, then turn a ShareGPT record into chat messages."""
    if not isinstance(record, dict):
        return record  # the record form's check names the wrong type
    if fields:
        missing = [c for c in fields.values() if c not in record]
        if missing:
            raise DataError(f"{where}: no column {', '.join(repr(m) for m in missing)} (from --data-fields); "
                            f"found: {', '.join(sorted(record)) or 'none'}")
        mapped = {field: record[column] for field, column in fields.items()}
        record = {k: v for k, v in record.items() if k not in fields.values() and k not in FIELDS.values()} | mapped
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
