"""A safetensors file's header read with plain reads (no library, no torch): what the memory
estimate (memory.py) and the lean loader (lean.py) read of a file before its weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def safetensors_header(path: Path, limit: int | None = None) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensors (name -> {dtype, shape, data_offsets}, its metadata left out)
    and where their data starts; ValueError for a header over `limit` bytes."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        if limit is not None and size > limit:
            raise ValueError(f"{path.name}: a header of {size} bytes")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size
