"""A GGUF file's header walked within bounds before anything parses it.

gguf's reader (and transformers through it) builds Python objects for every entry of every
metadata array: a 94 MB file holding one 20,000,000-entry array takes 8 GB and minutes. This
walks the header with no more than offsets, each count and length checked against the bounds
below and against the file's size, and refuses a file beyond them in one line, before the
tokenizer, the memory check or the weights read it. A file's verdict is kept for its version
(path, size, modification time).

The bound on the arrays together is what the reader after the walk can afford, measured: it
holds about `READER_BYTES` per number in an array and twice that per string (and takes about
8 microseconds a number on a 2-core machine): the largest vocabulary in use (Gemma 4: 262,144
tokens with scores and types, 514,906 merges: 2.08 million such units) takes it 1.4 GB and 16 s.
A header past `MAX_UNITS` would take it more than 1.7 GB and is refused.
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

from ..errors import ModelError

MAX_ARRAY = 1 << 21  # 2,097,152 entries: four times the largest array in use (Gemma 4's merges)
MAX_UNITS = 2_500_000  # all arrays together, a string two units: 1.2 times the largest vocabulary in use
READER_BYTES = 680  # gguf's reader's memory per unit, measured (a number's entry; a string's is twice)
MAX_STRING = 1 << 24  # one string (a chat template is tens of kB)
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
MAX_DIMS = 8
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types
_STRING, _ARRAY = 8, 9
_INTEGERS = {4: "I", 5: "i", 10: "Q", 11: "q"}  # the integer types a context length is written in


class _Refused(Exception):
    pass


class _Walk:
    def __init__(self, data: mmap.mmap, order: str):
        self.data, self.order, self.at, self.entries = data, order, 0, 0
        self.context: int | None = None  # `<arch>.context_length`, when the header says it
        self.architecture = ""  # `general.architecture`
        self.alignment = 32  # `general.alignment`: where the tensors' data starts
        self.tensors: list[TensorInfo] = []

    def take(self, size: int, what: str) -> int:
        if size < 0 or self.at + size > len(self.data):
            raise _Refused(f"{what} runs past the end of the file (truncated or not a GGUF file)")
        start, self.at = self.at, self.at + size
        return start

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack_from(self.order + fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int = MAX_STRING) -> None:
        size = self.number("Q", what)
        if size > limit:
            raise _Refused(f"{what} is {size:,} bytes long (at most {limit:,} are read)")
        self.take(size, what)

    def key(self) -> str:
        size = self.number("Q", "a metadata key")
        if size > 1 << 16:
            raise _Refused(f"a metadata key is {size:,} bytes long")
        start = self.take(size, "a metadata key")
        return bytes(self.data[start:start + size]).decode("utf-8", "replace")

    def value(self, kind: int, key: str, depth: int = 0) -> None:
        if kind in _SIZES:
            at = self.take(_SIZES[kind], f"metadata {key!r}")
            if depth == 0 and key.endswith(".context_length") and kind in _INTEGERS:
                self.context = struct.unpack_from(self.order + _INTEGERS[kind], self.data, at)[0]
            if depth == 0 and key == "general.alignment" and kind in _INTEGERS:
                self.alignment = struct.unpack_from(self.order + _INTEGERS[kind], self.data, at)[0] or 32
        elif kind == _STRING:
            start = self.at + 8
            self.string(f"metadata {key!r}")
            if depth == 0 and key == "general.architecture":
                self.architecture = bytes(self.data[start:self.at]).decode("utf-8", "replace")
        elif kind == _ARRAY and depth < 2:
            self.array(key, depth + 1)
        else:
            raise _Refused(f"metadata {key!r} has value type {kind}, which GGUF does not define here")

    def array(self, key: str, depth: int) -> None:
        kind, count = self.number("I", f"metadata {key!r}"), self.number("Q", f"metadata {key!r}")
        if count > MAX_ARRAY:
            raise _Refused(f"metadata {key!r} holds {count:,} entries (at most {MAX_ARRAY:,} are read)")
        self.entries += count * (2 if kind == _STRING else 1)
        if self.entries > MAX_UNITS:
            raise _Refused(f"its metadata arrays hold more than {MAX_UNITS:,} entries together (a string two), which "
                           f"gguf's reader would take more than {MAX_UNITS * READER_BYTES / 1e9:.1f} GB and minutes "
                           f"to parse")
        if kind in _SIZES:
            self.take(_SIZES[kind] * count, f"metadata {key!r}")
        elif kind == _STRING:
            self.strings(count, key)
        else:
            for _ in range(count):
                self.value(kind, key, depth)

    def strings(self, count: int, key: str) -> None:
        """`count` strings in a row (a vocabulary: hundreds of thousands), walked without a call each."""
        data, at, end, unpack = self.data, self.at, len(self.data), struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            if at + 8 > end:
                break
            size = unpack(data, at)[0]
            if size > MAX_STRING:
                raise _Refused(f"a string in metadata {key!r} is {size:,} bytes long (at most {MAX_STRING:,} are read)")
            at += 8 + size
        else:
            if at <= end:
                self.at = at
                return
        raise _Refused(f"metadata {key!r} runs past the end of the file (truncated or not a GGUF file)")


def check_gguf(path: Path) -> None:
    """Refuse (`ModelError`) a GGUF file whose header is malformed or beyond the bounds above."""
    gguf_context(path)


def gguf_context(path: Path) -> int | None:
    """The model's limit on positions its header says (`<arch>.context_length`), or None; the
    file checked as `check_gguf` does."""
    st = Path(path).stat()
    why, context = _verdict(str(path), st.st_size, st.st_mtime_ns)
    if why:
        raise ModelError(f"{path}: not read: {why}")
    return context


@functools.lru_cache(maxsize=16)
def _verdict(path: str, size: int, mtime_ns: int) -> tuple[str, int | None]:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return "", _walk(data).context
    except _Refused as exc:
        return str(exc), None
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        return f"cannot read it ({exc})", None


def _walk(data: mmap.mmap) -> "_Walk":
    if data[:4] != b"GGUF":
        raise _Refused("it does not start with GGUF's magic number")
    order = "<"
    version = struct.unpack_from("<I", data, 4)[0] if len(data) >= 8 else 0
    if version and not version & 0xFFFF:  # written on a big-endian machine
        order, version = ">", struct.unpack_from(">I", data, 4)[0]
    if version not in (2, 3):
        raise _Refused(f"GGUF version {version} is not read (2 and 3 are)")
    walk = _Walk(data, order)
    walk.at = 8
    tensors, keys = walk.number("Q", "the header"), walk.number("Q", "the header")
    if keys > MAX_KEYS or tensors > MAX_TENSORS:
        raise _Refused(f"its header announces {keys:,} metadata keys and {tensors:,} tensors "
                       f"(at most {MAX_KEYS:,} and {MAX_TENSORS:,})")
    for _ in range(keys):
        key = walk.key()
        walk.value(walk.number("I", f"metadata {key!r}"), key)
    for _ in range(tensors):
        start = walk.at + 8
        walk.string("a tensor's name", limit=1 << 16)
        name = bytes(data[start:walk.at]).decode("utf-8", "replace")
        dims = walk.number("I", "a tensor's shape")
        if dims > MAX_DIMS:
            raise _Refused(f"a tensor has {dims:,} dimensions")
        at = walk.take(8 * dims + 4 + 8, "a tensor's description")
        shape = struct.unpack_from(f"{order}{dims}Q", data, at)
        kind, offset = struct.unpack_from(f"{order}IQ", data, at + 8 * dims)
        walk.tensors.append(TensorInfo(name, tuple(shape), kind, offset))
    return walk


class TensorInfo(NamedTuple):
    """A tensor as the header describes it: `shape` as GGUF writes it (the row length first),
    `kind` its GGML type number, `offset` from the start of the tensors' data."""

    name: str
    shape: tuple[int, ...]
    kind: int
    offset: int


class Layout(NamedTuple):
    """What a GGUF file's header says of its tensors: where their data starts in the file."""

    architecture: str
    data_start: int
    tensors: tuple[TensorInfo, ...]


def gguf_layout(path: Path) -> Layout:
    """The file's architecture and tensors, from its header alone (checked as `check_gguf` does),
    walked once per file version (the engine's choice, the memory estimate and the load ask)."""
    check_gguf(path)
    st = Path(path).stat()
    return _layout(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _layout(path: str, size: int, mtime_ns: int) -> Layout:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        walk = _walk(data)
    align = walk.alignment
    return Layout(walk.architecture, (walk.at + align - 1) // align * align, tuple(walk.tensors))
