"""Streaming record writers, reading back what a previous run wrote (resume), and the
fingerprint that ties an output file to the spec, model and input that wrote it. No torch here.

Every record is written with one `write` and flushed, so a crash at any moment leaves at most one
partial trailing line; `read_done` drops it.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from .errors import OutputError
from .io import EXTENSIONS

FINGERPRINT_SUFFIX = ".prefixcache.json"


class RecordWriter:
    """Writes one record at a time as JSONL or CSV and flushes after each."""

    def __init__(self, stream: IO[str], fmt: str, columns: Sequence[str] = (), header: bool = True):
        self.stream, self.fmt, self.columns = stream, fmt, list(columns)
        self._csv = None
        if fmt == "csv":
            self._csv = csv.DictWriter(stream, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n")
            if header:
                self._csv.writeheader()
            stream.flush()

    def write(self, record: Mapping[str, Any]) -> None:
        if self._csv is not None:
            buffer = io.StringIO()
            csv.DictWriter(buffer, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n").writerow(
                {k: _csv_cell(v) for k, v in record.items()}
            )
            self.stream.write(buffer.getvalue())  # one write per record, quoted newlines included
        else:
            self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not sys.stdout:
            self.stream.close()


def _csv_cell(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return "" if value is None else value


def output_format(path: str) -> str:
    fmt = EXTENSIONS.get(Path(path).suffix.lower())
    if fmt is None:
        raise OutputError(f"{path}: output must end in .jsonl or .csv")
    return fmt


def open_writer(path: str | None, columns: Sequence[str] = (), append: bool = False) -> RecordWriter:
    """`path` None or '-' writes JSONL to stdout; otherwise the extension picks JSONL or CSV.
    With `append`, records go after what is there (a CSV header only if the file is empty)."""
    if path is None or path == "-":
        return RecordWriter(sys.stdout, "jsonl")
    fmt = output_format(path)
    fresh = not append or not os.path.exists(path) or os.path.getsize(path) == 0
    try:
        stream = open(path, "a" if append else "w", encoding="utf-8", newline="")
    except OSError as exc:
        raise OutputError(f"{path}: cannot write output: {exc.strerror}")
    return RecordWriter(stream, fmt, columns, header=fresh)


def check_output(path: str | None, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written or would be overwritten."""
    if path is None or path == "-":
        return
    output_format(path)
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{path}: is a directory")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"{path}: not writable")
    if target.exists() and target.stat().st_size > 0 and not (resume or overwrite):
        raise OutputError(f"{path}: already exists; use --resume to continue it or --overwrite to replace it")


@dataclass
class Done:
    """What a previous run wrote: its complete records in file order, and where they end."""

    records: list[dict[str, Any]]
    end: int  # byte offset just past the last complete record
    size: int  # the file's size (larger than `end` when a partial record trails)


def read_done(path: str) -> Done:
    """Read back the complete records of an output file; a partial trailing record is left out."""
    data = Path(path).read_bytes()
    parse = _done_jsonl if output_format(path) == "jsonl" else _done_csv
    records, end = parse(data, path)
    return Done(records, end, len(data))


def _done_jsonl(data: bytes, path: str) -> tuple[list[dict], int]:
    records, offset = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # the partial record a crash can leave
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if offset + len(line) == len(data):
                break
            raise OutputError(f"{path}: line {len(records) + 1} is not a record; is this a prefixcache output?")
        offset += len(line)
    return records, offset


def _done_csv(data: bytes, path: str) -> tuple[list[dict], int]:
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    if not lines or not lines[0].endswith("\n"):
        return [], 0
    header = next(csv.reader([lines[0]]))
    records, offset, pending, pending_len = [], len(lines[0].encode()), [], 0
    for line in lines[1:]:
        pending.append(line)
        pending_len += len(line.encode())
        if not line.endswith("\n"):
            break
        try:
            rows = list(csv.reader(pending))
        except csv.Error:
            continue
        if len(rows) == 1 and len(rows[0]) == len(header):
            records.append(dict(zip(header, rows[0])))
            offset += pending_len
            pending, pending_len = [], 0
    return records, offset


def truncate_partial(path: str, done: Done) -> bool:
    """Cut a partial trailing record off, so appending starts on a fresh line."""
    if done.size > done.end:
        with open(path, "r+b") as f:
            f.truncate(done.end)
        return True
    return False


def fingerprint_path(output: str) -> Path:
    return Path(output + FINGERPRINT_SUFFIX)


def write_fingerprint(output: str, fingerprint: Mapping[str, Any]) -> None:
    path = fingerprint_path(output)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the run's fingerprint: {exc.strerror}")


def check_fingerprint(output: str, fingerprint: Mapping[str, Any]) -> None:
    """Refuse to resume an output written by another spec, model or input."""
    path = fingerprint_path(output)
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutputError(f"{output}: cannot resume: {path.name} (the fingerprint of the run that wrote it) is missing; "
                          f"use --overwrite to start again")
    except (OSError, json.JSONDecodeError):
        raise OutputError(f"{output}: cannot resume: {path.name} is unreadable; use --overwrite to start again")
    changed = [k for k in fingerprint if previous.get(k) != fingerprint[k]]
    if changed:
        raise OutputError(f"{output}: cannot resume: it was written with a different {', '.join(changed)}; "
                          f"use --overwrite to start again, or another output file")


def file_digest(path: str) -> str:
    """sha256 of a file's bytes ('stdin' for '-')."""
    if path == "-":
        return "stdin"
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def start_output(output: str | None, resume: bool, fingerprint: Mapping[str, Any]) -> dict[str, dict]:
    """Fresh output: record the fingerprint. Resumed output: check it, drop a partial trailing
    record, and return the records already written, by str(id)."""
    log = logging.getLogger("prefixcache")
    if output is None or output == "-":
        return {}
    if resume and Path(output).exists():
        check_fingerprint(output, fingerprint)
        done = read_done(output)
        if truncate_partial(output, done):
            log.warning("%s: dropped a partial last record left by an interrupted run", output)
        log.info("%s: %d records already written; resuming", output, len(done.records))
        return {str(r.get("id")): r for r in done.records}
    write_fingerprint(output, fingerprint)
    return {}
