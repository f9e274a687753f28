"""The output record: made from an item's scores, its fields, and its CSV cells. No torch.

This is the only module that knows the record's layout; output.py owns the file it is written to.
A label task's record, in JSONL:

    {"id", "label", "prob", "margin", "probs": {label: p}, "logprobs": {label: lp},
     ["raw_probs": {label: p}], ["gold", "correct"], "normalize", ["readout"], "prefix_tokens",
     "item_tokens", "item_sha", "ms"}

With a fitted head (`head:` in the spec), "probs" and the label are the head's, "logprobs" stay the
prompt's, and "readout" says "head" (a pack: per question, "head" or "prompt").
A multi-label record has "labels" (the labels on, in label order) instead of "label", "prob" and
"margin"; its "probs" are each label's P(yes) against no, "logprobs" their logs, and "gold" a list.
Multiple choice adds "index" after "label" and holds "probs" and "logprobs" as lists in option
order. An item that could not be scored is `{"id", "item_sha", "error"}`. `item_sha` identifies
the item's content (all its fields), so a later run can tell an unchanged item from a changed one. In CSV, a label task's dicts become
one column per label (`prob_<label>`, `logprob_<label>`, `raw_prob_<label>`), lists are JSON in
one cell, and None is an empty cell (`to_csv_row`, `from_csv_row`). Reading a file back
(output.py) gives records in the JSONL layout whatever the file's format (ids from CSV stay text),
so resume, merge and evaluation never look at columns.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Iterable, Mapping, Optional, Sequence

from ..errors import InputError
from .items import Item, item_sha
from ..task.decision import Bounded, Decision
from ..task.head import Head
from ..task.kind import KINDS, pack_kind
from ..task.questions import Answers, Question, answer_distribution, answer_word, label_kind
from ..task.spec import TaskSpec

Record = dict[str, Any]
Keep = Optional[Sequence[str]]  # input fields a record carries; None: all
log = logging.getLogger("prefixcache")
PER_LABEL = (("raw_probs", "raw_prob_"), ("logprobs", "logprob_"), ("probs", "prob_"))  # longest column prefix first
_FLOATS = ("prob", "margin", "ms", "novelty", "p_correct")
_INTS = ("index", "prefix_tokens", "item_tokens")
_PER_QUESTION = ("pruned", "readout", "novelty", "p_correct")  # a pack's record: per question, JSON in a CSV cell


def make_record(spec: TaskSpec, item: Item, answers: Answers, prefix_tokens: int, item_tokens: int, ms: float,
                keep: Keep = (), precision: str | None = None, pruned: Sequence[int] | None = None) -> Record:
    """The record of a scored item from what its scores decide; `keep`: the item's fields to copy
    in after the id (None: all of them); `pruned` (a run with pruned scoring): the indices of the
    options whose log-prob is a bound. A pack's record holds its answers; a label spec's one
    question writes its own layout (its kind's `record`)."""
    record: Record = {"id": item.id, **kept_fields(item, spec.id_field, keep)}
    bounded = answers.bounded(pruned) if pruned is not None else None
    if spec.questions:
        record.update(_questions_record(spec, item, answers))
        if bounded is not None:
            record["pruned"] = bounded
    else:
        q, decision = answers.questions[0], answers.decisions[0]
        record.update(label_kind(spec).record(q, spec, item.record, decision, answers.logprobs[0]))
        if bounded is not None:
            record["pruned"] = bounded.get(q.id, [])
        record["normalize"] = spec.normalize + ("+calibrated" if decision.raw is not None else "")
    if spec.head is not None:  # which readout decided: the fitted head, or the prompt's scores
        read = {q.id: "head" if spec.head.readout_for(q.id) else "prompt" for q in answers.questions}
        record["readout"] = read if spec.questions else next(iter(read.values()))
        novelty = {q.id: round(n, 4) for q, n in zip(answers.questions, answers.novelty) if n is not None}
        if novelty:  # how far the item lies from the rows the head was fitted on (above 1: unlike them)
            record["novelty"] = novelty if spec.questions else next(iter(novelty.values()))
        worth = _p_correct(spec.head, answers)
        if worth:  # how often the head's held-out answers this sure were right
            record["p_correct"] = worth if spec.questions else next(iter(worth.values()))
    if precision is not None:  # a run mixing precisions says which made each record
        record["precision"] = precision
    record.update(
        prefix_tokens=prefix_tokens,
        item_tokens=item_tokens,
        item_sha=item_sha(item.record),
        ms=round(ms, 3),
    )
    return record


def _questions_record(spec: TaskSpec, item: Item, answers: Answers) -> Record:
    """A typed-questions record: question id -> answer (System One shape), and with gold
    questions, each one's expected answer and whether it was right."""
    record: Record = {"answers": answers.answers()}
    graded = [q for q in spec.questions if q.gold]
    if graded:
        record["gold"] = {q.id: pack_kind(q).option_of(q, item.record[q.gold]) for q in graded if q.gold}
        record["correct"] = {q.id: pack_kind(q).correct(q, record["answers"][q.id], record["gold"][q.id]) for q in graded}
    return record


def error_record(item: Item, message: str, id_field: str = "id", keep: Keep = ()) -> Record:
    return {"id": item.id, **kept_fields(item, id_field, keep), "item_sha": item_sha(item.record), "error": message}


def kept_fields(item: Item, id_field: str, keep: Keep) -> dict[str, Any]:
    """The item's fields a record carries: those named (missing ones as null), or with None all
    but the id (input read once is not scanned before the run: a field named like one of the
    record's own is refused at the item that has it, as a scanned input is refused before)."""
    if keep is None:
        clashes = [k for k in item.record if k in RECORD_FIELDS and k != id_field]
        if clashes:
            raise InputError(f"item {item.id}: --keep-all cannot keep the input field {clashes[0]!r}: it is named "
                             f"like a field of the record; rename it in the input, or name the fields to keep "
                             f"with --keep")
        return {k: v for k, v in item.record.items() if k != id_field}
    return {k: item.record.get(k) for k in keep}


# Names a kept field may not take: the record's own fields (and, in CSV, its per-label columns).
RECORD_FIELDS = ("id", "answers", "label", "labels", "index", "scored", "prob", "margin", "probs", "logprobs", "raw_probs", "pruned", "gold",
                 "correct",
                 "normalize", "readout", "novelty", "p_correct", "precision", "prefix_tokens", "item_tokens", "item_sha", "ms", "error")


def input_fields(record: Mapping[str, Any]) -> dict[str, Any]:
    """The input fields a record carries (those kept with --keep): all but its own fields."""
    prefixes = tuple(p for _, p in PER_LABEL)
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS and not k.startswith(prefixes)}


def keep_clash(spec: TaskSpec, name: str, csv: bool = False) -> str | None:
    """Why an input field cannot be copied into the records under its name, or None. In a CSV
    output any column named like a per-label one (prob_..., logprob_..., raw_prob_...) would be
    read back as one."""
    if name in RECORD_FIELDS:
        return f"{name!r} is a field of the record itself"
    if any(name == q.id or name.startswith(f"{q.id}{SEP}") for q in spec.questions) and csv:
        return f"{name!r} is named like a question's CSV columns"
    for _, prefix in PER_LABEL:
        if name.startswith(prefix) and (csv or name[len(prefix):] in spec.label_names):
            return f"{name!r} is named like the record's per-label CSV columns"
    return None


def is_error(record: Mapping[str, Any]) -> bool:
    return "error" in record


def id_text(item_id: object) -> str:
    """An id as text: how items and records are matched across runs and files."""
    return str(item_id)


def ids_digest(ids: Iterable[str]) -> str:
    """A digest of a sequence of ids (as text), in order: which items, in which order."""
    h = hashlib.sha256()
    for key in ids:
        h.update(key.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:32]


def record_id(record: Mapping[str, Any]) -> str:
    return id_text(record.get("id"))


def repeated(records: Iterable[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """The first record whose item an earlier one already holds, or None."""
    seen: set[str] = set()
    for record in records:
        key = record_id(record)
        if key in seen:
            return record
        seen.add(key)
    return None


def logprobs_in_order(record: Mapping[str, Any], names: Sequence[str], spec: TaskSpec | None = None
                      ) -> list[float] | None:
    """The log-probs a record holds, one per option in the order of `names` (for typed
    questions, `spec` given: each question's options in pack order, from its `x_logprobs`); None
    where it holds none (a head that answered alone)."""
    if spec is not None and spec.questions:
        pruned = record.get("pruned") or {}
        flags = [option in pruned.get(q.id, ()) for q in spec.questions for option in q.options]
        values = [float(record["answers"][q.id]["x_logprobs"][option]) for q in spec.questions for option in q.options]
        return Bounded(values, [i for i, flag in enumerate(flags) if flag]) if any(flags) else values
    value = record.get("logprobs")
    if value is None:
        return None
    if isinstance(value, list):
        return [float(v) for v in value]
    pruned = record.get("pruned") or ()
    return Bounded([float(value[name]) for name in names], [i for i, name in enumerate(names) if name in pruned])


def columns(spec: TaskSpec, keep: Sequence[str] = (), precision: bool = False, pruned: bool = False) -> list[str]:
    """CSV columns: the id, the kept input fields, the record's scalar fields, and one
    prob_/logprob_ column per label (for multiple choice, `probs` and `logprobs` are JSON lists in
    one cell each)."""
    if spec.questions:
        return ["id", *keep, *question_columns(spec.questions), *(["pruned"] if pruned else []),
                *(["readout"] if spec.head else []), *_head_columns(spec), *(["precision"] if precision else []),
                "prefix_tokens", "item_tokens", "item_sha", "ms", "error"]
    own, per_label = label_kind(spec).columns(spec)
    head = ["id", *keep, *own]
    gold = ["gold", "correct"] if spec.gold else []
    return (head + per_label + (["pruned"] if pruned else []) + gold + ["normalize"] + (["readout"] if spec.head else [])
            + _head_columns(spec) + (["precision"] if precision else [])
            + ["prefix_tokens", "item_tokens", "item_sha", "ms", "error"])


def _head_columns(spec: TaskSpec) -> list[str]:
    """The novelty and p_correct columns, where the spec's head keeps its fitted rows in brief and
    its held-out reliability."""
    head = spec.head
    return ((["novelty"] if head is not None and any(r.familiar for r in head.readouts) else [])
            + (["p_correct"] if head is not None and any(r.reliability for r in head.readouts) else []))


def _p_correct(head: Head, answers: Answers) -> dict[str, float]:
    """Per question a readout with a held-out reliability answered (not abstained): the share of
    its held-out answers this sure that were right."""
    out = {}
    for q, decision in zip(answers.questions, answers.decisions, strict=True):
        readout = head.readout_for(q.id)
        best = decision.best if isinstance(decision, Decision) else None  # tags have no one answer
        if readout is not None and readout.reliability is not None and best is not None:
            out[q.id] = round(readout.reliability.at(decision.probs[best]), 4)
    return out


def to_csv_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """One CSV row's cells: per-label dicts spread into columns, lists as JSON, None empty."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        prefix = dict(PER_LABEL).get(key)
        if key in ("answers", "gold", "correct") and "answers" in record:
            flat.update(flat_answers(record) if key == "answers" else {})
        elif prefix is not None and isinstance(value, dict):
            flat.update({f"{prefix}{name}": v for name, v in value.items()})
        else:
            flat[key] = value
    return {k: json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else "" if v is None else v
            for k, v in flat.items()}


def from_csv_row(row: Mapping[str, str]) -> Record:
    """A CSV row back in the JSONL layout (the inverse of `to_csv_row`, ids aside)."""
    if row.get("error"):  # an error row: its id, the kept fields, its digest and the error
        return {"id": row["id"], **input_fields(row), "item_sha": row.get("item_sha", ""), "error": row["error"]}
    qids = [key[: -len(TYPE_COLUMN)] for key in row if key.endswith(TYPE_COLUMN)]
    if qids:
        return _from_flat_answers(row, qids)
    record: Record = {}
    for key, cell in row.items():
        if key == "error":
            continue
        field = next(((f, key[len(p):]) for f, p in PER_LABEL if key.startswith(p)), None)
        if field is not None:
            if cell != "":  # empty: not in the record (a head that answered alone scored no option)
                record.setdefault(field[0], {})[field[1]] = float(cell)
        elif key in ("probs", "logprobs", "labels", "pruned") or (key == "gold" and "labels" in row):
            record[key] = json.loads(cell)  # lists are JSON (a multi-label gold too)
        elif key in _FLOATS + _INTS:
            record[key] = None if cell == "" else (float(cell) if key in _FLOATS else int(cell))
        elif key == "correct":
            record[key] = cell == "True"
        elif key == "label":
            record[key] = cell or None
        else:
            record[key] = cell
    return record


# -- typed questions in flat columns: `team`, `team__type`, `team__confidence`, `team__p__billing`, ...
SEP = "__"
TYPE_COLUMN = f"{SEP}type"
_SPREAD = {"probabilities": "p", "x_raw_probabilities": "raw", "x_logprobs": "lp"}  # answer dicts, one column per key
_ONE = {"x_raw_noul": "raw"}


def question_columns(questions: Sequence[Question]) -> list[str]:
    """Each question's flat columns: its value (the choice, P(yes) or the score), its type, then
    what its kind reports, and with gold the expected answer and whether it was right."""
    out = []
    for q in questions:
        out += [q.id, f"{q.id}{TYPE_COLUMN}"] + [f"{q.id}{SEP}{c}" for c in pack_kind(q).columns(q)]
        out += [f"{q.id}{SEP}gold", f"{q.id}{SEP}correct"] if q.gold else []
    return out


def flat_answers(record: Mapping[str, Any]) -> dict[str, Any]:
    """A typed-questions record's answers (and gold) as flat columns: `team`, `team__type`,
    `team__confidence`, `team__p__billing`, ..."""
    flat: dict[str, Any] = {}
    for qid, answer in record["answers"].items():
        kind = answer["type"]
        flat[qid], flat[f"{qid}{TYPE_COLUMN}"] = answer[kind], kind
        for key, value in answer.items():
            if key in ("type", kind):
                continue
            if key in _SPREAD:
                flat.update({f"{qid}{SEP}{_SPREAD[key]}{SEP}{name}": v for name, v in value.items()})
            else:
                flat[f"{qid}{SEP}{_ONE.get(key, key)}"] = value
        for key in ("gold", "correct"):
            if qid in record.get(key, {}):
                flat[f"{qid}{SEP}{key}"] = record[key][qid]
    return flat


def _from_flat_answers(row: Mapping[str, str], qids: Sequence[str]) -> Record:
    """A typed-questions CSV row back in the JSONL layout."""
    qids = sorted(qids, key=len, reverse=True)  # the longest id that names a column owns it
    record: Record = {}
    answers: dict[str, dict[str, Any]] = {}
    gold: dict[str, Any] = {}
    correct: dict[str, Any] = {}
    for key, cell in row.items():
        qid = next((q for q in qids if key == q or key.startswith(q + SEP)), None)
        if qid is None:
            if key in _PER_QUESTION:
                if cell != "":  # empty: not in the record (with a head: no question it reads was answered)
                    record[key] = json.loads(cell)
            elif key in _INTS + _FLOATS:
                record[key] = None if cell == "" else (float(cell) if key in _FLOATS else int(cell))
            elif key != "error" or cell:
                record[key] = cell
            continue
        answer = answers.setdefault(qid, {"type": row[qid + TYPE_COLUMN]})
        rest = key[len(qid) + len(SEP):] if key != qid else ""
        spread = next((k for k, short in _SPREAD.items() if rest.startswith(short + SEP)), None)
        if key == qid:
            answer[answer["type"]] = KINDS[answer["type"]].value_of(cell)
        elif rest == "type":
            continue
        elif spread is not None:
            if cell != "":  # empty: not in the answer (a head that answered alone scored no option)
                answer.setdefault(spread, {})[rest[len(_SPREAD[spread]) + len(SEP):]] = float(cell)
        elif rest == "gold":
            gold[qid] = cell
        elif rest == "correct":
            correct[qid] = None if cell == "" else cell == "True"
        elif rest == "legend":
            answer["legend"] = json.loads(cell)
        else:
            answer[next((k for k, short in _ONE.items() if short == rest), rest)] = float(cell)
    tail = ("prefix_tokens", "item_tokens", "item_sha", "ms")
    out = {"id": record.pop("id"), **{k: v for k, v in record.items() if k not in tail},
           "answers": {q: _ordered(a) for q, a in answers.items()}}
    if gold:
        out.update(gold=gold, correct=correct)
    return {**out, **{k: record[k] for k in tail if k in record}}


def _ordered(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer's keys in the order a run writes them."""
    order = ("type", "choice", "noul", "score", "legend", "probabilities", "confidence", "x_raw_probabilities",
             "x_raw_noul", "x_logprobs")
    return {k: answer[k] for k in sorted(answer, key=lambda k: order.index(k) if k in order else len(order))}


def question_ids(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The question ids of a typed-questions output, in its order (none for another output)."""
    first = next((r for r in records if not is_error(r)), None)
    return list(first["answers"]) if first is not None and "answers" in first else []


def question_view(record: Mapping[str, Any], qid: str) -> Record:
    """One question of a typed-questions record as a label task's record (its answer in a word
    as the label, its distribution as the probabilities, its gold and whether it was right): what
    diff and report compare and draw, question by question. Error records stay as they are."""
    if is_error(record):
        return dict(record)
    answer = record["answers"][qid]
    dist, word = answer_distribution(answer), answer_word(answer)
    label = None if word not in dist else word
    top = sorted(dist.values(), reverse=True)
    view: Record = {"id": record["id"], **input_fields(record), "label": label,
                    "prob": None if label is None else dist[label],
                    "margin": top[0] - top[1] if len(top) > 1 else 1.0, "probs": dist}
    if qid in record.get("gold", {}):
        view.update(gold=record["gold"][qid], correct=record["correct"][qid])
    return view
