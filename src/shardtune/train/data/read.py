"""Records from a data file: JSON Lines or a JSON array, or what the ``datasets`` library reads (sources.py),
each checked by its objective's record form, with the file and line named in every error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from shardtune.config import parse_fields
from shardtune.errors import read_text
from shardtune.train.data.records import DataError
from shardtune.train.data.sft import check_record
from shardtune.train.data.sources import is_datasets_source, location, normalize, read_rows


def read_records(path: str | Path, fields: str = "", check: Callable[[object, str], None] | None = None
                 ) -> list[tuple[int, dict]]:
    """(line number, record) pairs from a .jsonl file or a JSON array file, or (record index, record)
    from a source the ``datasets`` library reads (sources.py); ``fields``: the --data-fields mapping;
    ``check(record, where)``: the record form's check (default: the SFT forms)."""
    check = check or check_record
    if is_datasets_source(path):
        return _checked(read_rows(path), path, fields, check)
    path = Path(path)
    text = read_text(path, "data file", DataError)
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    records: list[tuple[int, object]] = []
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
        records = [(i + 1, r) for i, r in enumerate(items)]  # record index stands in for the line
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not records:
        raise DataError(f"{path}: no records")
    return _checked(records, path, fields, check)


def _checked(records: list[tuple[int, object]], path: str | Path, fields: str,
             check: Callable[[object, str], None]) -> list[tuple[int, dict]]:
    mapping = parse_fields(fields)
    records = [(n, normalize(r, mapping, location(path, n))) for n, r in records]
    for lineno, record in records:
        check(record, location(path, lineno))
    return records  # type: ignore[return-value]
