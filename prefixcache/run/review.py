"""`run --review FILE`: the items the run abstained on, for a person to label.

Written once the output is complete, from the output's records joined with the input's items by
id, so a resumed or updated run writes each abstained item once whatever the runs before it did
(the file is replaced, atomically). A row holds the item's id and its template fields, the
model's top guesses with their probabilities, and an empty gold column ready to fill (the spec's
gold field, else `gold`; a pack: each abstained question's gold field, else its id), as CSV or
JSONL by the file's extension; the labelled rows can go back to `fit` as they are.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from .. import safefile
from ..data.items import Item, item_sha, spreadsheet_safe
from ..data.records import Record, id_text
from ..errors import InputError
from ..task.spec import TaskSpec

GUESSES = 3  # top guesses shown for an abstained question


def abstained(record: Record) -> list[str]:
    """The questions a record abstained on: "" for a label spec's one, a pack's question ids;
    an error record or a multi-label record abstains on nothing."""
    if "error" in record:
        return []
    if "answers" in record:
        return [qid for qid, a in record["answers"].items() if isinstance(a, dict) and "choice" in a and a["choice"] is None]
    return [""] if "label" in record and record["label"] is None else []


def review_row(spec: TaskSpec, item: Item, record: Record, questions: list[str]) -> dict[str, Any]:
    """One abstained item's row: id, its fields, per abstained question the top guesses and an
    empty gold column."""
    row: dict[str, Any] = {"id": item.id}
    row.update({f: item.record.get(f) for f in spec.item_fields()})
    for qid in questions:
        probs = record["probs"] if qid == "" else record["answers"][qid].get("probabilities", {})
        prefix = f"{qid}_" if qid else ""
        for k, (option, p) in enumerate(sorted(probs.items(), key=lambda kv: -kv[1])[:GUESSES], start=1):
            row[f"{prefix}guess_{k}"], row[f"{prefix}prob_{k}"] = option, round(float(p), 6)
        row[gold_column(spec, qid)] = ""
    return row


def gold_column(spec: TaskSpec, qid: str) -> str:
    """Where a person writes the answer: the gold field `fit` reads."""
    if qid == "":
        return spec.gold or "gold"
    q = next(q for q in spec.questions if q.id == qid)
    return q.gold or qid


def review_rows(spec: TaskSpec, items: Iterable[Item], records: Mapping[str, Record]) -> list[dict[str, Any]]:
    """The rows of every item whose record abstained, in input order. An item whose fields are not
    those its record was scored from (`item_sha`: the input was replaced or edited since) is
    refused (InputError): a row must show the text that was scored beside its guesses."""
    rows = []
    for item in items:
        record = records.get(id_text(item.id))
        if record is None:
            continue
        questions = abstained(record)
        if questions and record.get("item_sha") not in (None, item_sha(item.record)):
            raise InputError(f"item {item.id!r}: the input holds other fields than those its record was scored from "
                             f"(the file was replaced or edited during the run); the review file is not written: run "
                             f"again with --update to score the changed items, then review")
        if questions:
            rows.append(review_row(spec, item, record, questions))
    return rows


def write_review(path: Path, rows: list[dict[str, Any]], what: str = "the review file") -> None:
    """The rows as CSV (a .csv file: every column any row has, in first-seen order; a text that a
    spreadsheet would run as a formula written with a leading apostrophe, which every CSV input
    reads back without it) or JSONL."""
    if path.suffix.lower() == ".csv":
        columns: dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(row))
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(columns) or ["id"], lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: spreadsheet_safe(v) for k, v in row.items()} for row in rows)
        body = text.getvalue()
    else:
        body = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    safefile.replace(path, body, what=what)
