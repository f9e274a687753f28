"""`run --review FILE`: exactly the abstained items, every field present, CSV or JSONL, each once
across a resumed run; refused where it cannot be written."""

from __future__ import annotations

import csv
import json

from helpers import invoke, json_lines


def _items(path, n, start=0):
    rows = [{"id": f"t{k}", "text": f"ticket {k}: " + "my invoice is wrong " * (k % 3) + "the app crashes " * (k % 2)}
            for k in range(start, start + n)]
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _median_prob(tmp_path, spec_file, items):
    """A threshold half the items fall below on the tiny model."""
    spec = spec_file(name="plain.yaml", labels=["billing", "technical", "account"])
    assert invoke("run", spec, items, "-o", tmp_path / "plain.jsonl").exit_code == 0
    probs = sorted(r["prob"] for r in json_lines(tmp_path / "plain.jsonl"))
    return (probs[len(probs) // 2 - 1] + probs[len(probs) // 2]) / 2


def test_the_review_file_holds_exactly_the_abstained_items(tmp_path, spec_file):
    items = _items(tmp_path / "in.jsonl", 12)
    cut = _median_prob(tmp_path, spec_file, items)
    spec = spec_file(labels=["billing", "technical", "account"], threshold=cut, gold="gold")
    review = tmp_path / "to_label.jsonl"
    result = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "--review", review, "--gold", "")
    assert result.exit_code == 0, result.output
    records = json_lines(tmp_path / "out.jsonl")
    abstained = [r["id"] for r in records if r["label"] is None]
    rows = json_lines(review)
    assert [r["id"] for r in rows] == abstained and abstained  # the threshold makes some abstain
    by_id = {r["id"]: r for r in records}
    for row in rows:
        assert row["text"].startswith("ticket ") and row["gold"] == ""
        top = sorted(by_id[row["id"]]["probs"].items(), key=lambda kv: -kv[1])
        assert [row[f"guess_{k}"] for k in (1, 2, 3)] == [name for name, _ in top]
        assert row["prob_1"] == round(top[0][1], 6) and row["prob_1"] < cut
    assert f"review: {len(rows)} abstained item" in result.stderr


def test_a_resumed_run_lists_each_abstained_item_once_in_csv(tmp_path, spec_file):
    items = _items(tmp_path / "in.jsonl", 6)
    spec = spec_file(labels=["billing", "technical", "account"], threshold=_median_prob(tmp_path, spec_file, items))
    out, review = tmp_path / "out.jsonl", tmp_path / "to_label.csv"
    assert invoke("run", spec, items, "-o", out, "--review", review).exit_code == 0
    _items(items, 6, start=6)  # the input grew: the run goes on from where it stopped
    again = invoke("run", spec, items, "-o", out, "--review", review, "--resume")
    assert again.exit_code == 0, again.output
    rows = list(csv.DictReader(review.open()))
    abstained = [r["id"] for r in json_lines(out) if r["label"] is None]
    assert [r["id"] for r in rows] == abstained and len(set(abstained)) == len(abstained)
    assert set(rows[0]) >= {"id", "text", "guess_1", "prob_1", "gold"}
    done = invoke("run", spec, items, "-o", out, "--review", review, "--resume")  # nothing left to score
    assert done.exit_code == 0 and [r["id"] for r in csv.DictReader(review.open())] == abstained


def test_review_needs_an_output_file_and_an_input_file(tmp_path, spec_file):
    spec = spec_file(labels=["billing", "technical"], threshold=0.6)
    items = _items(tmp_path / "in.jsonl", 3)
    to_stdout = invoke("run", spec, items, "--review", tmp_path / "r.csv")
    assert to_stdout.exit_code == 2 and "--review writes the abstained items" in to_stdout.stderr
    same = invoke("run", spec, items, "-o", tmp_path / "o.jsonl", "--review", tmp_path / "o.jsonl")
    assert same.exit_code == 2


def test_a_review_is_refused_when_the_input_changed_after_it_was_scored(tmp_path, spec_file):
    """The review's rows join the records with the input read again: an item whose fields are not
    those its record was scored from (the file replaced during the run) is refused, never shown
    beside another text's guesses."""
    import pytest

    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError
    from prefixcache.run.review import review_rows
    from prefixcache.task.specfile import load_spec

    spec = spec_file(labels=["billing", "technical"], threshold=1.0)  # every item abstains
    items = _items(tmp_path / "in.jsonl", 4)
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec, items, "-o", out, "--review", tmp_path / "r.jsonl").exit_code == 0
    records = {r["id"]: r for r in json_lines(out)}
    read = list(read_items(str(items)))
    assert len(review_rows(load_spec(spec), read, records)) == 4
    changed = [read[0].__class__(read[0].id, {**read[0].record, "text": "another text"}, read[0].line), *read[1:]]
    with pytest.raises(InputError, match="item 't0': the input holds other fields than those its record was scored"):
        review_rows(load_spec(spec), changed, records)
