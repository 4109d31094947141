"""Records from a data file: JSON Lines or a JSON array (gzip, bzip2 or xz compressed too: errors.read_text),
or what the ``datasets`` library reads (sources.py), each checked by its objective's record form, with the
file and line named in every error.

JSON is read strictly where Python's reader is lenient: a key given twice in one object (the reader keeps
the last, so the first is silently lost; duplicate YAML keys are refused for the same reason) and a lone
surrogate (``"\\ud800"``: half of a UTF-16 pair, no character, which the tokenizer cannot encode) are
refused naming the line (a JSON array's record index) and the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from shardtune.config import parse_fields
from shardtune.errors import read_text
from shardtune.train.data.records import DataError
from shardtune.train.data.sft import check_record
from shardtune.train.data.sources import is_datasets_source, json_files, location, normalize, read_rows


def read_records(path: str | Path, fields: str = "", check: Callable[[object, str], None] | None = None
                 ) -> list[tuple[int, dict]]:
    """(line number, record) pairs from a .jsonl file or a JSON array file, or (record index, record)
    from a folder of them (sources.json_files) or a source the ``datasets`` library reads (sources.py);
    ``fields``: the --data-fields mapping; ``check(record, where)``: the record form's check (default:
    the SFT forms)."""
    check = check or check_record
    if is_datasets_source(path):
        return _checked(read_rows(path), path, fields, check)
    if Path(path).is_dir():  # each file read and checked as one, its errors naming it; numbered as one source
        files = json_files(Path(path))
        if not files:
            raise DataError(f"{path} is a folder with no data files: expected .jsonl or .json files (gzip, bzip2 "
                            "or xz compressed too), Parquet, CSV or Arrow files, or a dataset saved by save_to_disk")
        records = [r for file in files for _, r in read_records(file, fields, check)]
        return list(enumerate(records, 1))
    path = Path(path)
    text = read_text(path, "data file", DataError)
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    records: list[tuple[int, object]] = []
    if text.lstrip().startswith("["):
        try:
            items = loads(text, lambda i: f"{path}, record {i}")
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
        records = [(i + 1, r) for i, r in enumerate(items)]  # record index stands in for the line
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((lineno, loads(line, lambda _, n=lineno: f"{path}:{n}")))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not records:
        raise DataError(f"{path}: no records")
    return _checked(records, path, fields, check)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _Twice(dict):
    """An object in which ``key`` was given twice."""

    key = ""


def loads(text: str, where: Callable[[int], str]) -> object:
    """``json.loads(text)``, refusing a key given twice and a lone surrogate (module doc): ``where(i)`` names
    the record (i: its index from 1 when ``text`` is an array of records, else 1)."""
    twice: list[str] = []

    def pairs(items: list[tuple[str, object]]) -> dict:
        obj = dict(items)
        if len(obj) != len(items):
            seen: set[str] = set()
            obj = _Twice(obj)
            obj.key = next(k for k, _ in items if k in seen or seen.add(k))
            twice.append(obj.key)
        return obj

    value = json.loads(text, object_pairs_hook=pairs)
    odd = twice or _SURROGATE_ESCAPE.search(text)  # only a \uD800-\uDFFF escape can make a lone surrogate
    if odd:
        for i, record in enumerate(value if isinstance(value, list) and text.lstrip().startswith("[") else [value], 1):
            problem = _strict_problem(record, "")
            if problem:
                raise DataError(f"{where(i)}: {problem}")
    return value


def _strict_problem(value: object, at: str) -> str | None:
    """A key given twice, or a string holding a lone surrogate, anywhere in ``value`` (``at``: where it is)."""
    if isinstance(value, _Twice):
        inside = f" in {at!r}" if at else ""
        return (f"key {value.key!r}{inside} is given twice; a JSON reader keeps the last silently, so the first "
                "would be lost: keep one")
    if isinstance(value, str):
        bad = next((c for c in value if "\ud800" <= c <= "\udfff"), None)
        return None if bad is None else (
            f"{repr(at) if at else 'the record'} holds a lone surrogate \\u{ord(bad):04x} (half of a UTF-16 pair, no "
            "character: a text cut inside an emoji, or written by a faulty encoder); fix or drop the record")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        problem = _strict_problem(item, f"{at}[{key}]" if isinstance(key, int) else f"{at}.{key}" if at else str(key))
        if problem:
            return problem
    return None


def _checked(records: list[tuple[int, object]], path: str | Path, fields: str,
             check: Callable[[object, str], None]) -> list[tuple[int, dict]]:
    mapping = parse_fields(fields)
    records = [(n, normalize(r, mapping, location(path, n))) for n, r in records]
    for lineno, record in records:
        check(record, location(path, lineno))
    return records  # type: ignore[return-value]
