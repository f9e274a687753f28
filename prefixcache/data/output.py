"""The output file and the files beside it. No torch.

- its format (JSONL or CSV, from the extension or asked), checked with the folder before any work,
  and the report files' targets (never the input, the spec or another output);
- `RecordWriter`: one `write` and a flush per record, so a crash leaves at most one partial line;
- `read_records`: the complete records back in the JSONL layout, whatever the format;
- the fingerprint file next to it (`<output>.prefixcache.json`), written and read.

How a run starts on it and continues it is resume.py's; the record itself (its fields, CSV
columns) is records.py's.
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
from typing import IO, Any, Iterator, Mapping, Sequence

from .. import safefile
from ..errors import OutputError
from .items import opening
from .lock import lock_path
from .records import TYPE_COLUMN, Record, from_csv_row, to_csv_row

log = logging.getLogger("prefixcache")

FINGERPRINT_SUFFIX = ".prefixcache.json"


# -- format ---------------------------------------------------------------------------------------
def output_format(path: str | None, asked: str | None = None) -> str:
    """The output's format: `asked` (jsonl or csv), else the file's extension; stdout is JSONL
    unless asked. An asked format the extension contradicts is an error."""
    if path is None or path == "-":
        return asked or "jsonl"
    found = file_format(path, asked)
    if asked and asked != found:
        raise OutputError(f"{path}: --output-format {asked} contradicts the file's extension")
    return found


OUTPUT_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def file_format(path: str, asked: str | None = None) -> str:
    """The format an output file's extension says; for another extension, the one asked for
    (--output-format)."""
    fmt = OUTPUT_EXTENSIONS.get(Path(path).suffix.lower(), asked)
    if fmt is None:
        raise OutputError(f"{path}: output must end in .jsonl or .csv, or give --output-format jsonl|csv")
    return fmt


class RecordWriter:
    """Writes one record at a time as JSONL or CSV and flushes after each."""

    def __init__(self, stream: IO[str], fmt: str, columns: Sequence[str] = (), header: bool = True,
                 id_column: str = "id"):
        self.stream, self.fmt, self.columns = stream, fmt, list(columns)
        self.written = 0  # records written by this writer
        if fmt == "csv" and header:  # the id column under the input's name for it
            try:
                self.stream.write(self._csv_line({c: id_column if c == "id" else c for c in self.columns}))
                stream.flush()
            except OSError as exc:
                raise self._failed(exc)

    def _csv_line(self, cells: Mapping[str, Any]) -> str:
        # The csv module quotes a field holding "\n" but not one holding a lone "\r", which every
        # reader takes for a line end: such a row is written with every field quoted.
        carriage = any("\r" in str(v) for v in cells.values())
        buffer = io.StringIO()
        csv.DictWriter(buffer, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n",
                       quoting=csv.QUOTE_ALL if carriage else csv.QUOTE_MINIMAL).writerow(cells)
        return buffer.getvalue()

    def write(self, record: Mapping[str, Any]) -> None:
        line = self._csv_line(to_csv_row(record)) if self.fmt == "csv" else json.dumps(record, ensure_ascii=False) + "\n"
        try:
            self.stream.write(line)  # one write per record, quoted newlines included
            self.stream.flush()
            self.written += 1
        except BrokenPipeError:
            raise
        except OSError as exc:  # a full disk, a quota: what was written before stays, --resume continues
            raise self._failed(exc)

    def _failed(self, exc: OSError) -> OutputError:
        return OutputError(f"{getattr(self.stream, 'name', 'output')}: cannot write the output: {exc.strerror or exc}")

    def close(self, failing: bool = False) -> None:
        """Close the file; `failing`: a write has already failed (its error is the one to report)."""
        if self.stream is sys.stdout:
            return
        try:
            self.stream.close()
        except OSError as exc:
            if not failing:
                raise self._failed(exc)


def open_writer(path: str | None, columns: Sequence[str] = (), append: bool = False, fmt: str | None = None,
                id_column: str = "id") -> RecordWriter:
    """`path` None or '-' writes to stdout (JSONL unless `fmt` says csv); otherwise `fmt` or the
    extension picks JSONL or CSV. With `append`, records go after what is there (a CSV header
    only if that is nothing); else the file is new (safefile.py)."""
    if path is None or path == "-":
        if sys.stdout is None or sys.stdout.closed:
            raise OutputError("stdout is closed; give an output file with -o")
        return RecordWriter(sys.stdout, fmt or "jsonl", columns, id_column=id_column)
    fmt = fmt or file_format(path)
    if append:
        stream = safefile.append(path, what="the output")
        fresh = os.fstat(stream.fileno()).st_size == 0
    else:
        stream, fresh = safefile.create(path, what="the output"), True
    return RecordWriter(stream, fmt, columns, header=fresh, id_column=id_column)


@dataclass
class Written:
    """What an output file holds: its complete records in file order, and where they end."""

    records: list[Record]
    end: int  # byte offset just past the last complete record
    size: int  # the file's size (larger than `end` when a partial record trails)


def read_records(path: str, fmt: str | None = None, strict: bool = False) -> Written:
    """The complete records of an output file, in the JSONL layout; a partial trailing record is
    left out, and so is a damaged last line (what a crash leaves) unless `strict` (a file given
    to diff or report, which a run does not continue)."""
    with opening(path, "no such file", "is a directory, not an output of run"):
        data = Path(path).read_bytes()
    parse = _read_jsonl if file_format(path, fmt) == "jsonl" else _read_csv
    records, end = parse(data, path, strict)
    return Written(records, end, len(data))


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and "id" in value and any(k in value for k in ("label", "labels", "answers", "error")) \
        and _well_formed(value)


def _well_formed(record: Mapping[str, Any]) -> bool:
    """The fields every reader relies on have their types (fields a record lacks are not asked for)."""
    if not _is_id(record["id"]):
        return False
    if "error" in record:
        return isinstance(record["error"], str)
    if "answers" in record:
        return _answers_well_formed(record["answers"])
    label, labels, prob, probs = record.get("label"), record.get("labels", []), record.get("prob"), record.get("probs", {})
    values = probs.values() if isinstance(probs, dict) else probs if isinstance(probs, list) else None
    return ((label is None or isinstance(label, str)) and isinstance(labels, list)
            and all(isinstance(v, str) for v in labels) and (prob is None or _is_number(prob))
            and values is not None and all(_is_number(v) for v in values))


def _answers_well_formed(answers: Any) -> bool:
    """Every answer has a type, its value, and number-valued probabilities and log-probabilities."""
    if not isinstance(answers, dict):
        return False
    for answer in answers.values():
        if not isinstance(answer, dict) or not isinstance(answer.get("type"), str) or answer["type"] not in answer:
            return False
        for key in ("probabilities", "x_logprobs"):
            values = answer.get(key, {})
            if not isinstance(values, dict) or not all(_is_number(v) for v in values.values()):
                return False
    return True


def _is_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_jsonl(data: bytes, path: str, strict: bool = False) -> tuple[list[Record], int]:
    records: list[Record] = []
    offset = 0
    for line in data.split(b"\n"):
        if offset + len(line) == len(data):
            break  # no line end: the partial record a crash can leave (or nothing)
        line += b"\n"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            record = None
        if not _is_record(record):
            if offset + len(line) == len(data) and not strict:
                break  # a damaged last line: dropped like a partial one
            raise OutputError(f"{path}: line {len(records) + 1} is not a record; is this a prefixcache output?")
        records.append(record)
        offset += len(line)
    return records, offset


def _read_csv(data: bytes, path: str, strict: bool = False) -> tuple[list[Record], int]:
    """The complete records of a CSV output and where they end: every row that the writer wrote,
    a field over the csv module's default size or a quoted newline (in a value or a column name)
    included."""
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_LIMIT))  # as large as what we write
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")  # records end in \n; \r or U+2028 inside a quoted id is not an end
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    rows = _csv_rows(lines)
    first = next(rows, None)
    if first is None:
        return [], 0
    header, offset = first
    questions = any(h.endswith(TYPE_COLUMN) for h in header)
    if not header or "error" not in header or not ({"label", "labels"} & set(header) or questions):
        raise OutputError(f"{path}: its header has no label (or question) and error columns; is this a prefixcache "
                          f"output?")
    header[0] = "id"  # written under the input's name for the id
    records: list[Record] = []
    for row, size in rows:
        if len(row) != len(header):
            if strict:
                raise OutputError(f"{path}: record {len(records) + 1} has {len(row)} columns, the header "
                                  f"{len(header)}; is this a prefixcache output?")
            break
        try:
            records.append(from_csv_row(dict(zip(header, row))))
        except (ValueError, json.JSONDecodeError):
            raise OutputError(f"{path}: record {len(records) + 1} is not a record; is this a prefixcache output?")
        offset += size
    return records, offset


CSV_FIELD_LIMIT = 1 << 30


def _csv_rows(lines: list[str]) -> Iterator[tuple[list[str], int]]:
    """Each complete CSV row (its last line ends in \n, every quote is closed) and its size in
    bytes; a row not finished ends the rows."""
    pending: list[str] = []
    size = 0
    for line in lines:
        pending.append(line)
        size += len(line.encode())
        if not line.endswith("\n"):
            return
        try:
            rows = list(csv.reader(pending, strict=True))
        except csv.Error:
            continue  # a quoted field goes on in the next line
        if len(rows) == 1:
            yield rows[0], size
            pending, size = [], 0


# -- checks, fingerprint and resume --------------------------------------------------------


def check_output(path: str | None, resume: bool = False, overwrite: bool = False, fmt: str | None = None,
                 continuable: bool = True) -> None:
    """Refuse, before any work, an output that cannot be written or would be overwritten."""
    if path is None or path == "-":
        if sys.stdout is None or sys.stdout.closed:  # `>&-`: found before the model loads, not after
            raise OutputError("stdout is closed; give an output file with -o")
        return
    file_format(path, fmt)
    target = Path(path)
    safefile.check_target(path)
    if target.exists() and target.stat().st_size > 0 and not (resume or overwrite):
        if not continuable:  # merge writes the whole output or nothing
            raise OutputError(f"{path}: already exists; use --overwrite to replace it")
        raise OutputError(f"{path}: already exists; use --resume to continue it, --update to bring it up to date "
                          f"with the input, or --overwrite to replace it")


def check_report(path: Path | None, what: str = "") -> None:
    """A report file asked for must be writable before the run, not found unwritable after it."""
    if path is not None:
        safefile.check_target(path, what)


def check_distinct(writes: Mapping[str, Any], reads: Mapping[str, Any], outputs: Sequence[str] = ()) -> None:
    """Refuse a file that one option writes and another reads or writes (a report named like the
    input, the spec or the output, or like one of the files the run keeps beside its output).
    Keys say how the user named each file ("--metrics", "the input"); a value of None or "-" is
    no file. `outputs`: the keys that name record outputs (their fingerprint and lock file are
    theirs alone)."""
    own = {}
    for key in outputs:
        path = writes.get(key, reads.get(key))
        if path not in (None, "-", ""):
            own[f"the fingerprint of {path}"] = fingerprint_path(str(path))
            own[f"the lock file of {path}"] = lock_path(str(path))
    named = [(what, path, True) for what, path in writes.items()] + \
        [(what, path, False) for what, path in {**reads, **own}.items()]
    named = [(what, str(path), writes_it) for what, path, writes_it in named if path not in (None, "-", "")]
    for n, (what, path, writes_it) in enumerate(named):
        for other, other_path, other_writes in named[n + 1:]:
            if (writes_it or other_writes) and _same_file(path, other_path):
                writer, target = (what, other) if writes_it else (other, what)
                raise OutputError(f"{writer} {path}: is {target}; write it to another file")


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def fingerprint_path(output: str) -> Path:
    return Path(output + FINGERPRINT_SUFFIX)


def write_fingerprint(output: str, fingerprint: Mapping[str, Any]) -> None:
    safefile.replace(fingerprint_path(output), json.dumps(fingerprint, indent=2, sort_keys=True) + "\n",
                     what="the run's fingerprint")


def fingerprint_of(output: str) -> dict[str, Any]:
    """An output's fingerprint as a report reads it: {} where there is none or it is unreadable (a
    file written by hand, or joined); `read_fingerprint` is for a run continuing the output."""
    try:
        found = json.loads(fingerprint_path(output).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_fingerprint(output: str) -> dict[str, Any]:
    path = fingerprint_path(output)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutputError(f"{output}: cannot continue it: {path.name} (the fingerprint of the run that wrote it) "
                          f"is missing; choose another output file, or --overwrite to start it again")
    except (OSError, json.JSONDecodeError):
        raise OutputError(f"{output}: cannot continue it: {path.name} is unreadable; choose another output file, "
                          f"or --overwrite to start it again")
