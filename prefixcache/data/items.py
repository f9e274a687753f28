"""Lazy readers for items: JSONL, CSV, TSV, a JSON array, Parquet (with pyarrow), any of the
text formats gzip-compressed (`.jsonl.gz`, ...), from files or stdin. No torch here.

Readers yield `Item`s one at a time, so memory stays flat however large the input is. Every
problem raises `InputError` naming the file and line (for Parquet: the row).
"""

from __future__ import annotations

import base64
import codecs
import csv
import datetime
import decimal
import gzip
import hashlib
import io
import itertools
import json
import logging
import math
import os
import stat
import sys
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, IO, Any, Callable, Generator, Iterator, Mapping, cast

from ..errors import InputError, UsageError, first_line

log = logging.getLogger("prefixcache")

INPUT_FORMATS = ("jsonl", "csv", "tsv", "json", "parquet")
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".json": "json",
              ".parquet": "parquet"}
PARQUET_EXTRA = "pip install 'prefixcache[parquet]'"


@dataclass(frozen=True)
class Item:
    id: Any
    record: Mapping[str, Any]
    line: int  # 1-based line where the record starts


def _extension_format(path: str) -> str | None:
    """The format a file name says, looking through a .gz ending."""
    name = Path(path).name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return EXTENSIONS.get(Path(name).suffix)


def detect_format(path: str, fmt: str | None, what: str = "input") -> str:
    if fmt:
        if fmt not in INPUT_FORMATS:
            raise InputError(f"unknown {what} format {fmt!r}; use one of {', '.join(INPUT_FORMATS)}")
        found = _extension_format(path) if path != "-" else None
        if found and found != fmt:
            raise InputError(f"{path}: --format {fmt} contradicts the file's extension")
        return fmt
    if path == "-":
        raise InputError(f"reading {what} from stdin needs an explicit format (--format jsonl, csv, ...)")
    found = _extension_format(path)
    if not found:
        raise InputError(f"{path}: cannot tell the format from the extension; use .jsonl, .csv, .tsv, .json or "
                         f".parquet (optionally .gz), or pass --format")
    return found


def is_stream(path: str) -> bool:
    """stdin ("-"), a pipe, a FIFO or a device given as a path: input that can be read only once,
    so it is not scanned before the run (nor hashed, nor re-read)."""
    if path == "-":
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False  # reported as "not found" when it is opened


def _open_binary(path: str) -> IO[bytes]:
    if path == "-":
        return sys.stdin.buffer
    with opening(path, "input file not found", "is a directory, not an input file"):
        if path.lower().endswith(".gz"):
            return cast(IO[bytes], gzip.open(path, "rb"))  # a GzipFile reads as a binary stream does
        return open(path, "rb")


@contextmanager
def opening(path: str, missing: str, folder: str) -> Iterator[None]:
    """Opening or reading `path`: its OS errors as one-line InputErrors (`missing` and `folder`
    say what the path was meant to be)."""
    try:
        yield
    except FileNotFoundError:
        raise InputError(f"{path}: {missing}")
    except IsADirectoryError:
        raise InputError(f"{path}: {folder}")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}")


MAX_LINE_BYTES = 1 << 26  # no item of any model's context needs a longer line (see scoring/prepare.py)


def _lines(stream: IO[bytes], name: str) -> Iterator[bytes]:
    """The stream's lines, each read up to MAX_LINE_BYTES: a longer one (an endless stream such as
    /dev/zero, a binary file) is an error, not a memory that grows without bound."""
    for lineno in itertools.count(1):
        raw = stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            raise InputError(f"{name}:{lineno}: a line longer than {MAX_LINE_BYTES >> 20} MiB; is this the right file?")
        yield raw


def _jsonl_records(stream: IO[bytes], name: str) -> Generator[tuple[int, Mapping[str, Any]], None, None]:
    for lineno, raw in enumerate(_lines(stream, name), 1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if not raw.endswith(b"\n") and exc.reason == "unexpected end of data":  # cut inside a character
                _unfinished(name, lineno)
                return
            raise InputError(f"{name}:{lineno}: not valid UTF-8 (byte {exc.start + 1} of the line)")
        if not text.strip():
            continue
        try:
            record = json.loads(text, parse_constant=_not_json, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            if not raw.endswith(b"\n"):  # an exporter still writing it: read once it is finished
                _unfinished(name, lineno)
                return
            raise InputError(f"{name}:{lineno}: malformed JSON: {exc.msg} (column {exc.colno})")
        except ValueError as exc:  # NaN / Infinity, a number of thousands of digits
            raise InputError(f"{name}:{lineno}: {_bad_value(exc)}")
        except RecursionError:
            raise InputError(f"{name}:{lineno}: JSON nested too deeply")
        if not isinstance(record, dict):
            raise InputError(f"{name}:{lineno}: expected a JSON object, got {type(record).__name__}")
        _check_text(record, name, lineno)
        yield lineno, record


_UNFINISHED: set[tuple[str, int]] = set()


def _unfinished(name: str, lineno: int) -> None:
    """A last line with no newline that is not JSON yet is one being written (a growing file):
    it is left for the next run, said once."""
    if (name, lineno) not in _UNFINISHED:
        _UNFINISHED.add((name, lineno))
        log.warning("%s:%d: the last line is not finished (no newline, not valid JSON yet): left for the next run, "
                    "which reads it once it is written (--resume skips what this run scores)", name, lineno)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (Python's json keeps the last of two silently)."""
    out = dict(pairs)
    if len(out) < len(pairs):
        twice = next(key for n, (key, _) in enumerate(pairs) if any(key == k for k, _ in pairs[:n]))
        raise ValueError(f"key {twice!r} is given twice in one object")
    return out


def _not_json(constant: str) -> Any:
    """NaN, Infinity and -Infinity: Python's json reads them, JSON has no such values."""
    raise ValueError(f"{constant} is not a JSON value (write null, or the number as a string)")


def _bad_value(exc: ValueError) -> str:
    if "digits" in str(exc):
        return "a number of more than 4300 digits; write it as a string"
    return first_line(exc)[:120]


def _check_text(record: Mapping[str, Any], name: str, lineno: int) -> None:
    """JSON may escape half of a UTF-16 surrogate pair (\\ud800), which is no text at all: no
    tokenizer or UTF-8 writer can take it."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{name}:{lineno}: contains an unpaired surrogate escape (like \\ud800), which is not text")
    except RecursionError:
        raise InputError(f"{name}:{lineno}: JSON nested too deeply")


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet may run as a formula


def spreadsheet_safe(cell: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (it starts with =, +, -, @, a tab or a
    carriage return), shown as text instead: a leading apostrophe, as OWASP's CSV-injection
    guidance says; a text that starts with apostrophes before such a character gets one more, so
    that what is read back is what was written. Numbers and other cells as they are. `unescaped`
    reads it back."""
    return "'" + cell if isinstance(cell, str) and cell.lstrip("'").startswith(FORMULA_STARTS) else cell


def unescaped(cell: str) -> str:
    """A CSV cell as `spreadsheet_safe` wrote it, read back: one of the apostrophes before a
    formula's first character dropped (every CSV input is read so)."""
    return cell[1:] if cell[:1] == "'" and cell.lstrip("'").startswith(FORMULA_STARTS) else cell


def _csv_records(stream: IO[bytes], name: str, delimiter: str = ",", encoding: str | None = None
                 ) -> Generator[tuple[int, Mapping[str, Any]], None, None]:
    text = _text_lines(stream, name, encoding)
    try:
        reader = csv.reader(text, delimiter=delimiter, strict=True)  # a quote never closed is an error
    except TypeError as exc:
        raise InputError(f"--delimiter {delimiter!r}: {exc}")
    start = 1
    try:
        header = next(reader, None)
        if header is None:
            return
        if len(set(header)) != len(header):
            raise InputError(f"{name}:1: duplicate column names in the CSV header")
        start = reader.line_num + 1
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                start = reader.line_num + 1
                continue
            if len(row) != len(header):
                raise InputError(f"{name}:{start}: expected {len(header)} columns, found {len(row)}"
                                 f"{_delimiter_hint(header, delimiter)}")
            yield start, {k: unescaped(v) for k, v in zip(header, row)}
            start = reader.line_num + 1
    except UnicodeDecodeError:
        raise InputError(f"{name}:{reader.line_num + 1}: not valid {encoding or 'UTF-8'} (see --encoding)")
    except UnicodeError as exc:  # UTF-16/32 without a byte-order mark
        raise InputError(f"{name}: not readable as {encoding}: {first_line(exc)}; give the byte order "
                         f"(--encoding {encoding}-le or {encoding}-be)")
    except csv.Error as exc:
        if "end of data" in str(exc):
            raise InputError(f"{name}:{start}: a quoted field opened in this row is never closed")
        raise InputError(f"{name}:{reader.line_num}: malformed CSV: {exc}")
    finally:
        if isinstance(text, io.TextIOWrapper):
            text.detach()


def _text_lines(stream: IO[bytes], name: str, encoding: str | None) -> Iterator[str] | io.TextIOWrapper:
    """The text of a CSV/TSV stream, decoded one physical line at a time so a bad byte is reported
    on its own line (a byte-oriented encoding: UTF-8, Latin-1, cp1252...); UTF-16/32 are decoded as
    a whole stream."""
    codec = codecs.lookup(encoding or "utf-8-sig")
    if codec.name.startswith(("utf-16", "utf-32")):
        return io.TextIOWrapper(stream, encoding=codec.name, newline="")
    return _decoded(stream, name, codec.name, encoding)


def _decoded(stream: IO[bytes], name: str, codec: str, asked: str | None) -> Iterator[str]:
    for lineno, raw in enumerate(_lines(stream, name), 1):
        try:
            yield raw.decode(codec)
        except UnicodeDecodeError as exc:
            raise InputError(f"{name}:{lineno}: not valid {asked or 'UTF-8'} (byte {exc.start + 1} of the line; "
                             f"see --encoding)")


def _json_array_records(stream: IO[bytes], name: str) -> Generator[tuple[int, Mapping[str, Any]], None, None]:
    """The objects of one top-level JSON array, decoded one at a time as the file is read; the
    array is strict JSON: values separated by commas, closed, nothing after it."""
    reader = _JsonArray(stream)
    try:
        if reader.next_char() != "[":
            raise InputError(f"{name}:{reader.line}: a .json input is one JSON array of objects ([{{...}}, ...])")
        reader.pos += 1
        if reader.next_char() == "]":
            reader.pos += 1
        else:
            while True:
                line, record = reader.value(name)
                _check_text(record, name, line)
                yield line, record
                after = reader.next_char()
                reader.pos += 1
                if after == "]":
                    break
                if after != ",":
                    raise InputError(f"{name}:{reader.line}: expected ',' or ']' after an object"
                                     + (", found the end of the file" if not after else f", found {after!r}"))
        if reader.next_char():
            raise InputError(f"{name}:{reader.line}: data after the end of the array")
    except UnicodeDecodeError:
        raise InputError(f"{name}:{reader.line}: not valid UTF-8")
    except ValueError as exc:  # NaN / Infinity, a number of thousands of digits
        raise InputError(f"{name}:{reader.line}: {_bad_value(exc)}")
    except RecursionError:
        raise InputError(f"{name}:{reader.line}: JSON nested too deeply")
    finally:
        reader.text.detach()


class _JsonArray:
    """A JSON array's text, read 64 KiB at a time: the position in it and the line there."""

    def __init__(self, stream: IO[bytes]):
        self.decoder = json.JSONDecoder(parse_constant=_not_json, object_pairs_hook=_unique_keys)
        self.text = io.TextIOWrapper(stream, encoding="utf-8-sig")
        self.buffer, self.pos, self.line = "", 0, 1

    def more(self) -> bool:
        chunk = self.text.read(1 << 16)
        self.buffer += chunk
        return bool(chunk)

    def next_char(self) -> str:
        """The next character that is not white space ("" at the end of the file)."""
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in " \t\r\n":
                self.line += self.buffer[self.pos] == "\n"
                self.pos += 1
            if self.pos < len(self.buffer) or not self.more():
                return self.buffer[self.pos:self.pos + 1]

    def value(self, name: str) -> tuple[int, dict]:
        """The object that starts here and the line it starts on; the position moves past it."""
        if not self.next_char():
            raise InputError(f"{name}:{self.line}: the array is never closed (no ']')")
        while True:
            try:
                record, end = self.decoder.raw_decode(self.buffer, self.pos)
                break
            except json.JSONDecodeError as exc:
                if len(self.buffer) - self.pos > MAX_LINE_BYTES:
                    raise InputError(f"{name}:{self.line}: an object longer than {MAX_LINE_BYTES >> 20} MiB")
                if not self.more():
                    raise InputError(f"{name}:{self.line}: malformed JSON: {exc.msg}")
        if not isinstance(record, dict):
            raise InputError(f"{name}:{self.line}: expected a JSON object, got {type(record).__name__}")
        line = self.line
        self.line += self.buffer.count("\n", self.pos, end)
        self.buffer, self.pos = self.buffer[end:], 0
        return line, record


def _parquet_records(path: str, name: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """Rows of a Parquet file, a batch at a time (row numbers stand for lines)."""
    try:
        import pyarrow.parquet as pq  # an optional extra
    except ImportError:
        raise InputError(f"{name}: reading Parquet needs pyarrow: {PARQUET_EXTRA}")
    import pyarrow

    try:
        rows = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                rows += 1
                yield rows, {key: _plain(value) for key, value in record.items()}
    except (OSError, ValueError, pyarrow.ArrowException) as exc:  # empty, truncated, not Parquet
        raise InputError(f"{name}: cannot read it as Parquet: {first_line(exc)[:160]}")


def _plain(value: Any) -> Any:
    """A Parquet value as JSON has it: dates and times in ISO 8601, decimals as exact strings,
    bytes as text (base64 when they are not UTF-8), NaN as null (how pandas writes a missing
    number)."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _check_encoding(encoding: str, fmt: str) -> None:
    """--encoding names a text encoding (not rot13 or hex), and the input is one it applies to."""
    try:
        name = codecs.lookup(encoding).name
        "x".encode(encoding)  # a codec that is no text encoding refuses this
    except LookupError:
        raise UsageError(f"--encoding {encoding!r}: no such text encoding (e.g. utf-8, latin-1, cp1252, utf-16)")
    if fmt not in ("csv", "tsv") and name not in ("utf-8", "utf-8-sig"):
        raise UsageError(f"--encoding {encoding}: applies to CSV and TSV inputs; JSON, JSONL and Parquet are read as "
                         f"UTF-8")


def read_items(path: str, fmt: str | None = None, id_field: str = "id", delimiter: str | None = None,
               encoding: str | None = None) -> Iterator[Item]:
    """Yield items lazily from a file (any format of INPUT_FORMATS, text ones optionally .gz) or
    stdin ('-'). `delimiter` and `encoding` apply to CSV and TSV. Items lacking `id_field` get
    their 1-based position in the input as id."""
    fmt = detect_format(path, fmt)
    name = "<stdin>" if path == "-" else path
    if delimiter is not None and len(delimiter) != 1:
        raise UsageError(f"--delimiter must be one character, not {delimiter!r}")
    if encoding is not None:
        _check_encoding(encoding, fmt)
    if fmt == "parquet":
        if path == "-" or is_stream(path):
            raise InputError("Parquet is read from a file, not a stream")
        yield from _items(_parquet_records(path, name), name, id_field)
        return
    stream = _open_binary(path)
    if fmt in ("csv", "tsv"):
        records = _csv_records(stream, name, delimiter or ("\t" if fmt == "tsv" else ","), encoding)
    else:
        records = (_jsonl_records if fmt == "jsonl" else _json_array_records)(stream, name)
    try:
        yield from _items(records, name, id_field)
    except (OSError, EOFError, zlib.error) as exc:  # a damaged .gz
        raise InputError(f"{name}: cannot read it: {first_line(exc)[:160]}")
    finally:
        records.close()  # its own clean-up first, while the stream is open
        if stream is not sys.stdin.buffer:
            stream.close()


def items_of(records: Iterable[Mapping[str, Any]], id_field: str = "id", name: str = "<items>") -> Iterator[Item]:
    """Items from records already in memory (dicts), numbered and checked as a file's would be."""
    return _items(((n, record) for n, record in enumerate(records, 1)), name, id_field)


def _items(records: Iterator[tuple[int, Mapping[str, Any]]], name: str, id_field: str) -> Iterator[Item]:
    for n, (lineno, record) in enumerate(records, 1):
        item_id = record.get(id_field)
        if item_id is None or item_id == "":
            item_id = n
        elif not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
            raise InputError(f"{name}:{lineno}: '{id_field}' must be a string or an integer")
        yield Item(item_id, record, lineno)


def duplicate_message(item_id: object, given: bool, first: tuple[int, bool], id_field: str) -> str:
    """The message for an id met twice, saying which of the two is an item's number (an item
    without an id is numbered by its position)."""
    line, first_given = first
    if given and first_given:
        return f"duplicate id {item_id!r} (first on line {line})"
    numbered = "this item, which has no" if not given else f"the item on line {line}, which has no"
    return (f"id {item_id!r} is given twice: {numbered} {id_field!r} and is numbered {item_id!r} by its position; "
            f"give every item an id, or none")


def _fields_hint(record: Mapping[str, Any], fmt: str | None) -> str:
    """The item's fields, and for a CSV read as one column whose name holds another separator, the
    --delimiter that would split it."""
    hint = f" (its fields: {', '.join(map(repr, record))})"
    return hint + (_delimiter_hint(list(record)) if fmt in ("csv", "tsv") else "")


def _delimiter_hint(header: list[str], delimiter: str | None = None) -> str:
    """For a header read as one column that holds another separator: the --delimiter to give."""
    if len(header) != 1:
        return ""
    for sep in (";", "\t", "|", ","):
        if sep != delimiter and sep in header[0]:
            return f"; the header looks {sep!r}-separated: give --delimiter {sep!r}"
    return ""


def item_sha(fields: Mapping[str, Any]) -> str:
    """A short digest of an item's fields (names and values, in any order)."""
    text = json.dumps(fields, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def text_digest(record: Mapping[str, Any], fields: Iterable[str]) -> str:
    """A short digest of what an item says in `fields` (the template's), whatever its id: case
    and runs of whitespace aside, so a copy of a text under another id or spacing is the same."""
    said = [" ".join(str(record.get(f, "")).split()).casefold() for f in fields]
    return hashlib.sha256(json.dumps(said, ensure_ascii=True).encode()).hexdigest()[:16]


class ItemsDigest:
    """What a run of items is, in order (each one's id and fields), and how many: the items the
    check before a run read, to compare with those the run then read (a file rewritten in place
    between the two, or while the run reads it, differs)."""

    def __init__(self, limit: int | None = None):
        self.count, self.limit, self._h = 0, limit, hashlib.sha256()
        self.last: Any = None  # the id of the last item added

    def add(self, item: Item) -> None:
        if self.limit is None or self.count < self.limit:
            self._h.update(f"{item.id!r}\0{item_sha(item.record)}\n".encode())
            self.count += 1
            self.last = item.id

    def follow(self, items: Iterable[Item]) -> Iterator[Item]:
        """`items`, each added as it passes."""
        for item in items:
            self.add(item)
            yield item

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def check_item(item: Item, check: Callable[[Mapping[str, Any]], None], name: str, fmt: str | None = None) -> None:
    """`check` (which raises ValueError with what is wrong) on one item of `name`: InputError
    naming its line, with the item's fields when it lacks one."""
    try:
        check(item.record)
    except ValueError as exc:
        shown = _fields_hint(item.record, fmt) if str(exc).startswith("lacks field") else ""
        raise InputError(f"{name}:{item.line}: item {item.id!r} {exc}{shown}")


def scan_items(path: str, fmt: str | None, id_field: str, check: Callable[[Mapping[str, Any]], None],
               id_required: bool = False, fields: dict[str, None] | None = None, delimiter: str | None = None,
               encoding: str | None = None, digest: ItemsDigest | None = None) -> int:
    """Read the whole input once before the model loads: syntax, unique ids (compared as the text
    they are written as, so 1 and "1" collide), and `check` (which raises ValueError with what is
    wrong). With `id_required`, an input where no item has `id_field` is an error (a misspelt
    field would otherwise number the items). `fields` collects every field name, in order of
    first appearance; `digest` every item. Returns the number of items."""
    seen: dict[str, tuple[int, bool]] = {}  # id text -> (line, whether the id was given or is the item's number)
    name = "<stdin>" if path == "-" else path
    count, with_id = 0, 0
    first_fields: list[str] = []
    for item in read_items(path, fmt, id_field, delimiter, encoding):
        check_item(item, check, name, fmt)
        key, given = str(item.id), item.record.get(id_field) not in (None, "")
        if key in seen:
            raise InputError(f"{name}:{item.line}: {duplicate_message(item.id, given, seen[key], id_field)}")
        seen[key] = (item.line, given)
        count += 1
        if digest is not None:
            digest.add(item)
        with_id += id_field in item.record
        first_fields = first_fields or list(item.record)
        if fields is not None:
            fields.update(dict.fromkeys(item.record))
    if id_required and count and not with_id:
        raise InputError(f"{name}: no item has the id field {id_field!r} set by the spec's 'id_field'; "
                         f"the items' fields are {', '.join(map(repr, first_fields))}")
    return count
