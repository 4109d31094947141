"""How many bytes a GGUF file promises, read from its header: a file cut short is named before any reader maps it.

A GGUF file is: magic, version, tensor count, metadata count; the metadata (key, type, value); the tensor
infos (name, dimensions, type, offset into the data); then the data, which starts at the next multiple
of ``general.alignment`` (32 by default). The file must reach the end of its last tensor's data. gguf's
own reader maps the file and fails on a short one with numpy's reshape error, naming neither the file
nor the cause; this reads only the header, with ``struct``.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import BinaryIO

# GGUF metadata value types: the fixed-size ones as struct formats; 8: string, 9: array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class CutShort(ValueError):
    """The file ends before what its header says it holds."""


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise CutShort("it ends inside its header")
    return struct.unpack(fmt, raw)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    raw = f.read(n)
    if len(raw) != n:
        raise CutShort("it ends inside its header")
    return raw.decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int):
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS:  # skipped whole: a tokenizer's token types are 100k+ values
            f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
            return None
        return [_value(f, item) for _ in range(count)]
    raise ValueError(f"unknown metadata value type {kind} (not a GGUF file gguf can read?)")


def data_end(path: Path) -> tuple[int, str]:
    """(the byte the file's last tensor data ends at, that tensor's name), from the header alone.
    ``CutShort`` when the file ends inside its header; ``ValueError`` for a header it cannot read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} (before 2) is not read here")
        tensors, entries = _read(f, "<Q"), _read(f, "<Q")
        alignment = 32
        for _ in range(entries):
            key, kind = _string(f), _read(f, "<I")
            value = _value(f, kind)
            if key == "general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        end, last = 0, ""
        for _ in range(tensors):
            name = _string(f)
            dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
            kind, offset = _read(f, "<I"), _read(f, "<Q")
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            nbytes = math.prod(dims) // block * size
            if offset + nbytes >= end:
                end, last = offset + nbytes, name
        start = f.tell() + (-f.tell() % alignment)
    return start + end, last


def check_complete(path: Path) -> str | None:
    """Why the GGUF file at ``path`` is cut short (None: it holds every byte its header promises, or its
    header is of a kind this reader does not know, left to gguf's reader)."""
    size = path.stat().st_size
    try:
        end, last = data_end(path)
    except CutShort as err:
        return f"{err} ({size} bytes)"
    except (ValueError, KeyError, OSError):
        return None
    if size < end:
        return f"its header places tensor {last}'s data up to byte {end}, but the file has {size} bytes"
    return None
