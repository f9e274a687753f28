"""The record: made from scores, written as JSONL and CSV, read back in the JSONL layout. No model."""

from __future__ import annotations

import json

import pytest
from helpers import make_spec

from prefixcache.data.items import Item
from prefixcache.data.records import (
    columns,
    error_record,
    item_sha,
    logprobs_in_order,
    make_record,
)
from prefixcache.data.output import open_writer, read_records
from prefixcache.task import labels_kind, options_kind
from prefixcache.task.decision import judge
from prefixcache.task.questions import Answers

LABELS = ["tech", "billing, refunds", 'say "hi"']


def _label_record(spec, item_id, logprobs, prior=None):
    decision = judge(logprobs, spec.normalize, [2, 3, 4], LABELS, prior=prior, threshold=spec.threshold)
    item = Item(item_id, {"text": "x", "answer": "tech"}, 1)
    answers = Answers((labels_kind.LABELS.question(spec),), (decision,), (tuple(logprobs),))
    return make_record(spec, item, answers, prefix_tokens=40, item_tokens=7, ms=1.23456)


def _round_trip(tmp_path, spec, records, name):
    written = {}
    for ext in ("jsonl", "csv"):
        path = tmp_path / f"{name}.{ext}"
        writer = open_writer(str(path), columns(spec))
        for record in records:
            writer.write(record)
        writer.close()
        written[ext] = read_records(str(path)).records
    return written


def test_label_records_read_back_the_same_from_jsonl_and_csv(tmp_path):
    spec = make_spec(tmp_path, labels=LABELS, gold="answer", calibrate=["N/A"], threshold=0.9)
    records = [
        _label_record(spec, "a", [-0.1, -3.2, -5.0], prior=[0.5, 0.3, 0.2]),
        _label_record(spec, 7, [-1.0, -1.1, -1.2], prior=[0.2, 0.4, 0.4]),  # abstains: below the threshold
        error_record(Item("c", {"body": "x"}, 3), "item 'c': lacks field 'text' used by the template"),
    ]
    assert list(records[0]) == ["id", "label", "prob", "margin", "probs", "logprobs", "raw_probs", "gold", "correct",
                                "normalize", "prefix_tokens", "item_tokens", "item_sha", "ms"]
    assert records[0]["item_sha"] == item_sha({"answer": "tech", "text": "x"}) != item_sha({"text": "x"})
    assert records[1]["label"] is None and records[1]["prob"] is None and records[1]["correct"] is False
    assert records[0]["normalize"] == "sum+calibrated" and records[0]["ms"] == 1.235
    got = _round_trip(tmp_path, spec, records, "labels")
    assert got["jsonl"] == records
    as_text = [{**r, "id": str(r["id"])} for r in records]
    assert got["csv"] == as_text  # CSV keeps ids as text, everything else as written


def test_csv_columns_spread_labels(tmp_path):
    spec = make_spec(tmp_path, labels=LABELS)
    path = tmp_path / "o.csv"
    writer = open_writer(str(path), columns(spec))
    writer.write(_label_record(spec, 1, [-0.5, -1.0, -2.0]))
    writer.close()
    header = path.read_text().splitlines()[0]
    assert header == ('id,label,prob,margin,prob_tech,"prob_billing, refunds","prob_say ""hi""",logprob_tech,'
                      '"logprob_billing, refunds","logprob_say ""hi""",normalize,prefix_tokens,item_tokens,item_sha,ms,error')


def test_multiple_choice_records_round_trip(tmp_path):
    spec = make_spec(tmp_path, labels=None, choices="choices", gold="answer")
    options = ["four", "two", "six"]
    decision = judge([-2.0, -0.5, -3.0], "sum", [1, 1, 1], options)
    item = Item(3, {"text": "legs?", "choices": options, "answer": "four"}, 1)
    answers = Answers((options_kind.OPTIONS.question(spec, options),), (decision,), ((-2.0, -0.5, -3.0),))
    record = make_record(spec, item, answers, 12, 5, 0.5)
    assert (record["label"], record["index"], record["correct"]) == ("two", 1, False)
    assert isinstance(record["probs"], list) and logprobs_in_order(record, options) == [-2.0, -0.5, -3.0]
    got = _round_trip(tmp_path, spec, [record], "mc")
    assert got["jsonl"] == [record] and got["csv"] == [{**record, "id": "3"}]


def test_a_partial_last_record_is_left_out(tmp_path):
    spec = make_spec(tmp_path, labels=LABELS)
    record = _label_record(spec, "a", [-0.1, -3.2, -5.0])
    for ext in ("jsonl", "csv"):
        path = tmp_path / f"cut.{ext}"
        writer = open_writer(str(path), columns(spec))
        writer.write(record)
        writer.close()
        whole = path.read_bytes()
        path.write_bytes(whole + whole.splitlines(keepends=True)[-1][:25])
        written = read_records(str(path))
        assert len(written.records) == 1 and written.end == len(whole) and written.size > written.end


def test_logprobs_in_candidate_order():
    record = {"logprobs": {"b": -2.0, "a": -1.0}}
    assert logprobs_in_order(record, ["a", "b"]) == [-1.0, -2.0]
    with pytest.raises(KeyError):
        logprobs_in_order(record, ["a", "c"])
    assert json.loads(json.dumps(record)) == record


def test_a_packs_head_fields_read_back_from_csv_where_a_record_lacks_one():
    """A pack run with a head writes per question, as JSON in one cell each, which readout
    answered, how far the item lies from the fitted rows and how often such answers were right;
    an item whose every head-read question abstained has no p_correct: its cell is empty, and the
    record read back lacks it as the JSONL one does."""
    from prefixcache.data.records import from_csv_row

    row = {"id": "1", "q": "a", "q__type": "choice", "readout": '{"q": "head"}', "novelty": '{"q": 0.5}',
           "p_correct": "", "ms": "1.0", "error": ""}
    record = from_csv_row(row)
    assert record["readout"] == {"q": "head"} and record["novelty"] == {"q": 0.5} and "p_correct" not in record
    assert from_csv_row({**row, "p_correct": '{"q": 0.75}'})["p_correct"] == {"q": 0.75}
