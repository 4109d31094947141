"""The safetensors header, read and written without touching tensor data.

Writers that stream tensors one at a time (the merge, the benchmarks' fake checkpoints) must know
the header before the first tensor; readers that only need names, shapes and sizes (the planner)
must not map gigabytes to get them. The format: an 8-byte little-endian length, a JSON header,
then the data, which the safetensors library starts 8-byte aligned.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

#: torch dtype → the name safetensors stores.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
#: The name safetensors stores → torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


def encode_header(entries: Iterable[tuple[str, torch.dtype, Iterable[int]]],
                  metadata: dict[str, str] | None = None) -> bytes:
    """The bytes that precede the data of tensors ``(name, dtype, shape)`` stored in this order."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        shape = list(shape)
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(raw)) + raw


def header_with_length(path: Path) -> tuple[dict, int]:
    """The header as stored (``__metadata__`` included) and its length in bytes. ``ValueError`` names
    the file when it is too short for its header or the header is not a JSON mapping."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"{path} is not a safetensors file, or is truncated ({size} bytes, no complete header)")
        text = f.read(length)
    try:
        header = json.loads(text)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
        raise ValueError(f"{path}: its safetensors header is not valid JSON (the file is damaged)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its safetensors header is not a mapping (the file is damaged)")
    return header, length


def read_header(path: Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file (``__metadata__`` left out)."""
    header, _ = header_with_length(path)
    header.pop("__metadata__", None)
    return header
