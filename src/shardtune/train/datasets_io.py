"""Data beyond our JSON Lines: what the ``datasets`` library loads, column mapping, ShareGPT records.

Sources read with ``datasets`` (an optional extra: ``pip install 'shardtune[datasets]'``):
  a directory written by ``Dataset.save_to_disk`` (a DatasetDict: its "train" split),
  ``.parquet``, ``.csv`` and ``.arrow`` files, and a Hub dataset id (``org/name[@revision]``), resolved
  like a Hub model id (model/hub.py: the Hugging Face cache, then a download unless offline) to a local
  snapshot that ``datasets`` reads. ``.json``/``.jsonl`` files stay with data.py's reader, whose errors
  name the line.
``--data-fields prompt=question,response=answer`` maps other column names onto the record shapes
(prompt/instruction, input, response/output, messages, text, conversations).
ShareGPT records ``{"conversations": [{"from": "human"|"gpt"|"system", "value": …}]}`` become chat
messages (loss on the assistant turns only).
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from shardtune.config import FIELDS, ConfigError
from shardtune.train.records import DataError, Dataset, Example

log = logging.getLogger("shardtune")

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
        return record  # data.py names the wrong type
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


class TokenizedExamples(Sequence):
    """Tokenized records as three flat tensors (ids, labels, offsets) instead of one Python list per record.

    About 8 bytes per token instead of about 70 in lists of ints, and, loaded from the cache with
    ``mmap=True``, shared by every rank of the machine through the page cache. Indexing gives the
    same ``Example`` objects the training loop always used.
    """

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, offsets: torch.Tensor) -> None:
        self.ids, self.labels, self.offsets = ids, labels, offsets

    @classmethod
    def build(cls, examples: Iterable) -> TokenizedExamples:
        ids, labels, offsets = array("i"), array("i"), array("q", [0])
        for ex in examples:
            ids.extend(ex.input_ids)
            labels.extend(ex.labels)
            offsets.append(len(ids))
        # The tensors view the arrays' memory (no copy: for a million records that is ~0.8 GB less at
        # the peak); the instance keeps the arrays, which own it.
        out = cls(torch.frombuffer(ids, dtype=torch.int32) if ids else torch.zeros(0, dtype=torch.int32),
                  torch.frombuffer(labels, dtype=torch.int32) if labels else torch.zeros(0, dtype=torch.int32),
                  torch.frombuffer(offsets, dtype=torch.int64))
        out._arrays = (ids, labels, offsets)
        return out

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return Example(self.ids[a:b].tolist(), self.labels[a:b].tolist())


def cache_key(path: str | Path, tokenizer, seq_len: int, fields: str) -> str:
    """What the tokenized records depend on: the data (path, size, mtime), tokenizer, chat template, options."""
    p = local_source(path)  # a Hub id: its snapshot, whose folder names the commit
    stat = _identity(p) if p.is_file() else []
    if p.is_dir():
        stat = [f"{f.relative_to(p)}:{_identity(f)}" for f in sorted(p.rglob("*")) if f.is_file()]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [str(p.resolve()) if p.exists() else str(path), *stat, str(seq_len), fields,
             backend.to_str() if backend is not None else repr(tokenizer), str(tokenizer.chat_template),
             str(tokenizer.bos_token_id), str(tokenizer.eos_token_id), CACHE_VERSION]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


CACHE_VERSION = "2"
#: files up to this size are keyed by their content too (hashing them costs less than tokenizing them)
HASHED_BYTES = 64 << 20


def _identity(file: Path) -> list[str]:
    """What tells a file's content apart without trusting the modification time alone: an edit in place
    that keeps size and mtime (``touch -r``, a copy with preserved times) still changes ctime, and a small
    file's content hash decides outright."""
    st = file.stat()
    parts = [str(st.st_size), str(st.st_mtime_ns), str(st.st_ctime_ns), str(st.st_ino)]
    if st.st_size <= HASHED_BYTES:
        parts.append(hashlib.sha256(file.read_bytes()).hexdigest())
    return parts


def load_cached(cache_dir: Path, key: str):
    """The Dataset tokenized before (by preflight or another rank), memory-mapped; None when absent."""
    file = cache_dir / f"tokens-{key}.pt"
    if not file.is_file():
        return None
    try:
        saved = torch.load(file, mmap=True, weights_only=True)
        examples = TokenizedExamples(saved["ids"], saved["labels"], saved["offsets"])
        if int(examples.offsets[-1]) != len(examples.ids) or len(examples.ids) != len(examples.labels):
            raise ValueError("its arrays do not fit together")
        return Dataset(examples, int(saved["truncated"]), int(saved["without_targets"]))
    except Exception as err:  # truncated, damaged or of another layout: tokenize again
        log.warning("the token cache entry %s is unreadable (%s: %s); tokenizing the data again", file,
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        file.unlink(missing_ok=True)
        return None


def save_cached(cache_dir: Path, key: str, dataset) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    ex = dataset.examples
    file, tmp = cache_dir / f"tokens-{key}.pt", cache_dir / f"tokens-{key}.pt.{os.getpid()}.tmp"
    torch.save({"ids": ex.ids, "labels": ex.labels, "offsets": ex.offsets,
                "truncated": dataset.truncated, "without_targets": dataset.without_targets}, tmp)
    os.replace(tmp, file)  # several ranks may write it at once: each file is complete
