"""The output record: made from an item's scores, written as JSONL or CSV, read back. No torch.

This is the only module that knows the record's layout. A label task's record, in JSONL:

    {"id", "label", "prob", "margin", "probs": {label: p}, "logprobs": {label: lp},
     ["raw_probs": {label: p}], ["gold", "correct"], "normalize", "prefix_tokens", "item_tokens",
     "item_sha", "ms"}

Multiple choice adds "index" after "label" and holds "probs" and "logprobs" as lists in option
order. An item that could not be scored is `{"id", "item_sha", "error"}`. `item_sha` identifies
the item's content (all its fields), so a later run can tell an unchanged item from a changed one. In CSV, a label task's dicts become
one column per label (`prob_<label>`, `logprob_<label>`, `raw_prob_<label>`), lists are JSON in
one cell, and None is an empty cell. Reading a file back gives records in the JSONL layout
whatever the file's format (ids from CSV stay text), so resume, merge and evaluation never look
at columns.

Every record is written with one `write` and flushed, so a crash at any moment leaves at most one
partial trailing line; `read_records` leaves it out.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence

from ..errors import OutputError
from .items import Item
from ..task.decision import Decision
from ..task.spec import TaskSpec, gold_value, option_of

Record = dict[str, Any]
Keep = Optional[Sequence[str]]  # input fields a record carries; None: all
PER_LABEL = (("raw_probs", "raw_prob_"), ("logprobs", "logprob_"), ("probs", "prob_"))  # longest column prefix first
_FLOATS = ("prob", "margin", "ms")
_INTS = ("index", "prefix_tokens", "item_tokens")


def _r6(x: float) -> float:
    return round(x, 6)


def make_record(spec: TaskSpec, item: Item, names: Sequence[str], logprobs: Sequence[float], decision: Decision,
                prefix_tokens: int, item_tokens: int, ms: float, keep: Keep = (), precision: str | None = None) -> Record:
    """The record of a scored item. `names`: its candidates' texts (labels or options), in order;
    `keep`: the item's fields to copy in after the id (None: all of them)."""
    best, probs = decision.best, decision.probs
    record: Record = {"id": item.id, **kept_fields(item, spec.id_field, keep),
                      "label": None if best is None else names[best]}
    if spec.choices:
        record["index"] = best
        record["scored"] = spec.score_by
    record.update(prob=None if best is None else _r6(probs[best]), margin=_r6(decision.margin))
    if spec.choices:
        record.update(probs=[_r6(p) for p in probs], logprobs=list(logprobs))
    else:
        record.update(probs={n: _r6(p) for n, p in zip(names, probs)}, logprobs=dict(zip(names, logprobs)))
        if decision.raw is not None:
            record["raw_probs"] = {n: _r6(p) for n, p in zip(names, decision.raw)}
    if spec.gold:
        gold = gold_value(item.record, spec.gold)
        meant = option_of(gold, list(names)) if spec.choices else gold  # multiple choice: a letter names an option
        record.update(gold=gold, correct=record["label"] is not None and record["label"] == meant)
    record["normalize"] = spec.normalize + ("+calibrated" if decision.raw is not None else "")
    if precision is not None:  # a run mixing precisions says which made each record
        record["precision"] = precision
    record.update(
        prefix_tokens=prefix_tokens,
        item_tokens=item_tokens,
        item_sha=item_sha(item.record),
        ms=round(ms, 3),
    )
    return record


def error_record(item: Item, message: str, id_field: str = "id", keep: Keep = ()) -> Record:
    return {"id": item.id, **kept_fields(item, id_field, keep), "item_sha": item_sha(item.record), "error": message}


def kept_fields(item: Item, id_field: str, keep: Keep) -> dict[str, Any]:
    """The item's fields a record carries: those named (missing ones as null), or with None all
    but the id."""
    if keep is None:
        return {k: v for k, v in item.record.items() if k != id_field}
    return {k: item.record.get(k) for k in keep}


# Names a kept field may not take: the record's own fields (and, in CSV, its per-label columns).
RECORD_FIELDS = ("id", "label", "index", "scored", "prob", "margin", "probs", "logprobs", "raw_probs", "gold", "correct",
                 "normalize", "precision", "prefix_tokens", "item_tokens", "item_sha", "ms", "error")


def input_fields(record: Mapping[str, Any]) -> dict[str, Any]:
    """The input fields a record carries (those kept with --keep): all but its own fields."""
    prefixes = tuple(p for _, p in PER_LABEL)
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS and not k.startswith(prefixes)}


def keep_clash(spec: TaskSpec, name: str) -> str | None:
    """Why an input field cannot be copied into the records under its name, or None."""
    if name in RECORD_FIELDS:
        return f"{name!r} is a field of the record itself"
    for _, prefix in PER_LABEL:
        if name.startswith(prefix) and name[len(prefix):] in spec.label_names:
            return f"{name!r} is one of the record's CSV columns"
    return None


def item_sha(fields: Mapping[str, Any]) -> str:
    """A short digest of an item's fields (names and values, in any order)."""
    text = json.dumps(fields, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_error(record: Mapping[str, Any]) -> bool:
    return "error" in record


def id_text(item_id: Any) -> str:
    """An id as text: how items and records are matched across runs and files."""
    return str(item_id)


def ids_digest(ids: Any) -> str:
    """A digest of a sequence of ids (as text), in order: which items, in which order."""
    h = hashlib.sha256()
    for key in ids:
        h.update(key.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:32]


def record_id(record: Mapping[str, Any]) -> str:
    return id_text(record.get("id"))


def logprobs_in_order(record: Mapping[str, Any], names: Sequence[str]) -> list[float]:
    """The raw log-probs a record holds, in the order of `names` (its candidates' texts)."""
    value = record["logprobs"]
    if isinstance(value, list):
        return [float(v) for v in value]
    return [float(value[name]) for name in names]


def columns(spec: TaskSpec, keep: Sequence[str] = (), precision: bool = False) -> list[str]:
    """CSV columns: the id, the kept input fields, the record's scalar fields, and one
    prob_/logprob_ column per label (for multiple choice, `probs` and `logprobs` are JSON lists in
    one cell each)."""
    head = ["id", *keep, "label"] + (["index", "scored"] if spec.choices else []) + ["prob", "margin"]
    if spec.choices:
        per_label = ["probs", "logprobs"]
    else:
        names = list(spec.label_names)
        per_label = [f"prob_{n}" for n in names] + [f"logprob_{n}" for n in names]
        per_label += [f"raw_prob_{n}" for n in names] if spec.content_free else []
    gold = ["gold", "correct"] if spec.gold else []
    return (head + per_label + gold + ["normalize"] + (["precision"] if precision else [])
            + ["prefix_tokens", "item_tokens", "item_sha", "ms", "error"])


def to_csv_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """One CSV row's cells: per-label dicts spread into columns, lists as JSON, None empty."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        prefix = dict(PER_LABEL).get(key)
        if prefix is not None and isinstance(value, dict):
            flat.update({f"{prefix}{name}": v for name, v in value.items()})
        else:
            flat[key] = value
    return {k: json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else "" if v is None else v
            for k, v in flat.items()}


def from_csv_row(row: Mapping[str, str]) -> Record:
    """A CSV row back in the JSONL layout (the inverse of `to_csv_row`, ids aside)."""
    if row.get("error"):
        return {"id": row["id"], "item_sha": row.get("item_sha", ""), "error": row["error"]}
    record: Record = {}
    for key, cell in row.items():
        if key == "error":
            continue
        field = next(((f, key[len(p):]) for f, p in PER_LABEL if key.startswith(p)), None)
        if field is not None:
            record.setdefault(field[0], {})[field[1]] = float(cell)
        elif key in ("probs", "logprobs"):
            record[key] = json.loads(cell)
        elif key in _FLOATS + _INTS:
            record[key] = None if cell == "" else (float(cell) if key in _FLOATS else int(cell))
        elif key == "correct":
            record[key] = cell == "True"
        elif key == "label":
            record[key] = cell or None
        else:
            record[key] = cell
    return record


# -- files --------------------------------------------------------------------------------------
def output_format(path: str | None, asked: str | None = None) -> str:
    """The output's format: `asked` (jsonl or csv), else the file's extension; stdout is JSONL
    unless asked. An asked format the extension contradicts is an error."""
    if path is None or path == "-":
        return asked or "jsonl"
    found = file_format(path)
    if asked and asked != found:
        raise OutputError(f"{path}: --output-format {asked} contradicts the file's extension")
    return found


OUTPUT_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def file_format(path: str) -> str:
    fmt = OUTPUT_EXTENSIONS.get(Path(path).suffix.lower())
    if fmt is None:
        raise OutputError(f"{path}: output must end in .jsonl or .csv")
    return fmt


class RecordWriter:
    """Writes one record at a time as JSONL or CSV and flushes after each."""

    def __init__(self, stream: IO[str], fmt: str, columns: Sequence[str] = (), header: bool = True,
                 id_column: str = "id"):
        self.stream, self.fmt, self.columns = stream, fmt, list(columns)
        if fmt == "csv" and header:  # the id column under the input's name for it
            self.stream.write(self._csv_line({c: id_column if c == "id" else c for c in self.columns}))
            stream.flush()

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
        except BrokenPipeError:
            raise
        except OSError as exc:  # a full disk, a quota: what was written before stays, --resume continues
            raise OutputError(f"{getattr(self.stream, 'name', 'output')}: cannot write the output: {exc.strerror or exc}")

    def close(self) -> None:
        if self.stream is not sys.stdout:
            self.stream.close()


def open_writer(path: str | None, columns: Sequence[str] = (), append: bool = False, fmt: str | None = None,
                id_column: str = "id") -> RecordWriter:
    """`path` None or '-' writes to stdout (JSONL unless `fmt` says csv); otherwise `fmt` or the
    extension picks JSONL or CSV. With `append`, records go after what is there (a CSV header only
    if the file is empty)."""
    if path is None or path == "-":
        if sys.stdout is None or sys.stdout.closed:
            raise OutputError("stdout is closed; give an output file with -o")
        return RecordWriter(sys.stdout, fmt or "jsonl", columns, id_column=id_column)
    fmt = fmt or file_format(path)
    fresh = not append or not os.path.exists(path) or os.path.getsize(path) == 0
    try:
        stream = open(path, "a" if append else "w", encoding="utf-8", newline="")
    except OSError as exc:
        raise OutputError(f"{path}: cannot write output: {exc.strerror}")
    return RecordWriter(stream, fmt, columns, header=fresh, id_column=id_column)


@dataclass
class Written:
    """What an output file holds: its complete records in file order, and where they end."""

    records: list[Record]
    end: int  # byte offset just past the last complete record
    size: int  # the file's size (larger than `end` when a partial record trails)


def read_records(path: str) -> Written:
    """The complete records of an output file, in the JSONL layout; a partial trailing record is
    left out."""
    data = Path(path).read_bytes()
    parse = _read_jsonl if file_format(path) == "jsonl" else _read_csv
    records, end = parse(data, path)
    return Written(records, end, len(data))


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and "id" in value and ("label" in value or "error" in value)


def _read_jsonl(data: bytes, path: str) -> tuple[list[Record], int]:
    records, offset = [], 0
    for line in data.split(b"\n"):
        if offset + len(line) == len(data):
            break  # no line end: the partial record a crash can leave (or nothing)
        line += b"\n"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            record = None
        if not _is_record(record):
            if offset + len(line) == len(data):
                break  # a damaged last line: dropped like a partial one
            raise OutputError(f"{path}: line {len(records) + 1} is not a record; is this a prefixcache output?")
        records.append(record)
        offset += len(line)
    return records, offset


def _read_csv(data: bytes, path: str) -> tuple[list[Record], int]:
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")  # records end in \n; \r or U+2028 inside a quoted id is not an end
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    if not lines or not lines[0].endswith("\n"):
        return [], 0
    header = next(csv.reader([lines[0]]))
    if not header or not {"label", "error"} <= set(header):
        raise OutputError(f"{path}: its header has no label and error columns; is this a prefixcache output?")
    header[0] = "id"  # written under the input's name for the id
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
            try:
                records.append(from_csv_row(dict(zip(header, rows[0]))))
            except (ValueError, json.JSONDecodeError):
                raise OutputError(f"{path}: record {len(records) + 1} is not a record; is this a prefixcache output?")
            offset += pending_len
            pending, pending_len = [], 0
    return records, offset
