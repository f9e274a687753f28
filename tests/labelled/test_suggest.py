"""`prefixcache suggest` end to end on a tiny model: n distinct items, never one labelled already
(by id, by text, by a filled gold, or fitted on by the head), the head's guess in the gold column;
and `fit` again on the grown file measures the new labels' gain on the same folds."""

from __future__ import annotations

import csv
import json

import pytest
from helpers import invoke, write_spec

pytest.importorskip("sklearn")
LABELS = ["billing", "technical"]
WORDS = {"billing": ["invoice", "refund", "charge", "payment"], "technical": ["crash", "error", "bug", "freeze"]}


def _rows(n, start=0, gold=True):
    out = []
    for k in range(start, start + n):
        label = LABELS[k % 2]
        text = " ".join(WORDS[label][(k // 2 + j) % 4] for j in range(1 + k % 3)) + f" case {k}"
        out.append({"id": f"i{k}", "text": text, **({"gold": label} if gold else {})})
    return out


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("suggest")
    spec = write_spec(tmp, model=str(tiny_model_dir), labels=LABELS, gold="gold")
    labelled = _write(tmp / "labelled.jsonl", _rows(16))
    out = tmp / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", out, "--folds", "3", "-q", "--features", "state")
    assert result.exit_code == 0, result.output
    return spec, out, labelled


def _read(path):
    return list(csv.DictReader(path.open())) if path.suffix == ".csv" else [
        json.loads(line) for line in path.read_text().splitlines()]


def test_with_a_head_never_an_item_it_was_fitted_on(fitted, tmp_path):
    _, out, _ = fitted
    pool = _write(tmp_path / "pool.jsonl", _rows(40, gold=False))  # the 16 fitted on are in it, unlabelled
    target = tmp_path / "next.csv"
    result = invoke("suggest", out, pool, "-n", "8", "-o", target)
    assert result.exit_code == 0, result.output
    rows = _read(target)
    assert len(rows) == len({r["id"] for r in rows}) == 8
    assert all(int(r["id"][1:]) >= 16 for r in rows)
    assert all(r["gold"] in LABELS and 0.5 <= float(r["prob"]) <= 1 for r in rows)
    margins = [float(r["margin"]) for r in rows]
    assert margins == sorted(margins)
    assert list(rows[0]) == ["id", "text", "gold", "prob", "margin", "picked_by"]
    assert {r["picked_by"] for r in rows} == {"least sure"}


def test_never_a_labelled_item_by_id_text_or_gold(fitted, tmp_path):
    spec, _, _ = fitted
    rows = _rows(30, gold=False)
    rows[3]["gold"] = "billing"  # labelled in the pool
    other = _write(tmp_path / "other.jsonl", [{"id": "elsewhere", "text": rows[5]["text"].upper() + "  "},
                                                  {"id": rows[7]["id"], "text": "anything"}])
    pool = _write(tmp_path / "pool.jsonl", rows)
    target = tmp_path / "seed.jsonl"
    result = invoke("suggest", spec, pool, "-n", "26", "-o", target, "--labelled", other)
    assert result.exit_code == 0, result.output
    got = {r["id"] for r in _read(target)}
    assert len(got) == 26 and not got & {"i3", "i5", "i7"}
    assert all(r["gold"] == "" and "margin" not in r for r in _read(target))  # no head: nothing guessed
    assert "seed set" in result.stderr


def test_a_pool_labelled_through_is_refused(fitted, tmp_path):
    _, out, labelled = fitted
    result = invoke("suggest", out, labelled, "-o", tmp_path / "x.csv")
    assert result.exit_code == 2 and "every item of the pool is labelled already" in result.stderr
    assert not (tmp_path / "x.csv").exists()


def test_fit_on_the_grown_file_measures_the_new_labels_on_the_same_folds(fitted, tmp_path):
    spec, _, _ = fitted
    out = tmp_path / "fitted.yaml"
    first = invoke("fit", spec, _write(tmp_path / "l1.jsonl", _rows(12)), "-o", out, "--folds", "3", "-q")
    assert first.exit_code == 0, first.output
    assert "prefixcache fit ·" not in first.stderr  # -q: no evaluation tables, as its help says
    assert "since_last_fit" not in json.loads((tmp_path / "fitted.fit.json").read_text())["questions"][0]
    grown = invoke("fit", spec, _write(tmp_path / "l2.jsonl", _rows(24)), "-o", out, "--folds", "3", "--overwrite")
    assert grown.exit_code == 0, grown.output
    since = json.loads((tmp_path / "fitted.fit.json").read_text())["questions"][0]["since_last_fit"]
    assert since["items"] == 12 and since["gain"]["low"] <= since["gain"]["value"] <= since["gain"]["high"]
    assert "since the last fit (12 of these items, the same folds)" in grown.stderr


def test_fit_reads_several_labelled_files_as_one_and_refuses_an_id_in_two(fitted, tmp_path):
    spec, _, _ = fitted
    first, second = _write(tmp_path / "a.jsonl", _rows(10)), _write(tmp_path / "b.jsonl", _rows(8, start=10))
    both = invoke("fit", spec, first, second, "-o", tmp_path / "f.yaml", "--folds", "3", "-q")
    assert both.exit_code == 0, both.output
    assert json.loads((tmp_path / "f.fit.json").read_text())["items"] == 18
    again = invoke("fit", spec, first, _write(tmp_path / "c.jsonl", _rows(3, start=9)), "-o", tmp_path / "g.yaml")
    assert again.exit_code == 2 and "item i9 is labelled in" in again.stderr


def test_suggest_and_review_never_write_over_the_head_the_spec_or_what_they_read(fitted, tmp_path):
    spec, out, labelled = fitted
    pool = _write(tmp_path / "pool.jsonl", _rows(10, start=100, gold=False))
    head = out.with_name("fitted.head.safetensors")
    before = head.read_bytes()
    for target, what in ((head, "is the spec's head"), (out, "is the spec"), (pool, "is POOL"),
                         (labelled, "is --labelled")):
        result = invoke("suggest", out, pool, "-n", 2, "-o", target, "--overwrite", "--labelled", labelled)
        assert result.exit_code == 2 and what in result.stderr, (target, result.stderr)
    for target, what in ((head, "is the spec's head"), (out, "is the spec"), (pool, "is the input")):
        result = invoke("run", out, pool, "-o", tmp_path / "o.jsonl", "--review", target, "--overwrite", "--gold", "")
        assert result.exit_code == 2 and what in result.stderr, (target, result.stderr)
    assert head.read_bytes() == before
    keep = tmp_path / "my-labels.csv"  # a file of the user's: --review replaces it only with --overwrite
    keep.write_text("id,text,gold\nx,y,billing\n")
    result = invoke("run", out, pool, "-o", tmp_path / "o2.jsonl", "--review", keep, "--gold", "")
    assert result.exit_code == 2 and "already exists; use --overwrite" in result.stderr
    assert keep.read_text() == "id,text,gold\nx,y,billing\n" and not (tmp_path / "o2.jsonl").exists()


def test_text_a_spreadsheet_would_run_is_written_as_text_and_read_back_as_it_was(fitted, tmp_path):
    spec, out, labelled = fitted
    hostile = ["+cmd|' /C calc'!A0", "=HYPERLINK(\"http://x\")", "-2+3", "@SUM(A1)", "\tindented", "plain text",
               "'=already quoted", "''-5", "'plain"]
    pool = _write(tmp_path / "pool.jsonl", [{"id": f"p{k}", "text": t} for k, t in enumerate(hostile)])
    result = invoke("suggest", out, pool, "-n", len(hostile), "-o", tmp_path / "to_label.csv")
    assert result.exit_code == 0, result.output
    cells = [row["text"] for row in csv.DictReader((tmp_path / "to_label.csv").open())]
    assert sorted(cells) == sorted(("'" + t if t.lstrip("'")[:1] in tuple("=+-@\t") else t) for t in hostile)  # OWASP
    from prefixcache.data.items import read_items

    back = [item.record["text"] for item in read_items(str(tmp_path / "to_label.csv"))]
    assert sorted(back) == sorted(hostile)  # fit and suggest --labelled read the texts as they were


def test_a_text_copied_under_many_ids_is_offered_once(fitted, tmp_path):
    spec, out, labelled = fitted
    rows = [{"id": f"copy{k}", "text": "Invoice  refund please"} for k in range(20)]  # one text, twenty ids
    rows += [{"id": f"d{k}", **{k2: v for k2, v in r.items() if k2 != "gold"}} for k, r in enumerate(_rows(6, 200))]
    pool = _write(tmp_path / "pool.jsonl", rows)
    result = invoke("suggest", out, pool, "-n", 5, "-o", tmp_path / "s.jsonl")
    assert result.exit_code == 0, result.output
    texts = [" ".join(r["text"].split()).casefold() for r in _read(tmp_path / "s.jsonl")]
    assert len(texts) == 5 == len(set(texts)) and "19 copies of a text offered once" in result.stderr


def test_random_rows_are_drawn_without_the_model_and_fit_estimates_on_them_alone(fitted, tmp_path):
    """--random draws a uniform, seeded sample (no model read, no guess to anchor the labeller);
    fit trains on every row but estimates and certifies on the rows drawn at random."""
    spec, out, _ = fitted
    pool = _write(tmp_path / "pool.jsonl", _rows(60, start=100, gold=False))
    drawn = tmp_path / "random.csv"
    result = invoke("suggest", out, pool, "-n", "12", "--random", "-o", drawn)
    assert result.exit_code == 0, result.output
    assert "drawn at random" in result.stderr and "loading the model" not in result.stderr
    rows = _read(drawn)
    assert len(rows) == 12 and {r["picked_by"] for r in rows} == {"random"} and all(r["gold"] == "" for r in rows)
    again = tmp_path / "again.csv"
    assert invoke("suggest", out, pool, "-n", "12", "--random", "-o", again).exit_code == 0
    assert [r["id"] for r in _read(again)] == [r["id"] for r in rows]  # seeded
    picked = [{**r, "picked_by": "least sure"} for r in _rows(8, start=200)]
    random_rows = [{**r, "picked_by": "random"} for r in _rows(12, start=300)]
    labelled = _write(tmp_path / "mixed.jsonl", picked + random_rows)
    result = invoke("fit", spec, labelled, "-o", tmp_path / "mixed.yaml", "--folds", "3")
    assert result.exit_code == 0, result.output
    question = json.loads((tmp_path / "mixed.fit.json").read_text())["questions"][0]
    assert any("stands on the 12 rows drawn at random" in n for n in question["notes"]), question["notes"]
    assert max(row["answered"] for row in question["risk_coverage"]) == 12
    few = _write(tmp_path / "few.jsonl", picked + random_rows[:4])
    result = invoke("fit", spec, few, "-o", tmp_path / "few.yaml", "--folds", "3")
    assert result.exit_code == 0, result.output
    notes = json.loads((tmp_path / "few.fit.json").read_text())["questions"][0]["notes"]
    assert any("label rows of `suggest --random`" in n for n in notes), notes


def test_an_audit_draws_from_the_items_a_run_answered_and_the_gate_reads_it(fitted, tmp_path):
    """--audit OUTPUT draws a uniform, seeded sample of the items the run answered (never one it
    abstained on), read by no model; labelled, the file goes through run --min-answered-accuracy."""
    _, out, _ = fitted
    pool = _write(tmp_path / "month.jsonl", _rows(40, start=400, gold=False))
    first = tmp_path / "first.jsonl"
    assert invoke("run", out, pool, "-o", first, "-q", "--gold", "").exit_code == 0
    probs = sorted(json.loads(line)["prob"] for line in first.read_text().splitlines())
    cut = (probs[len(probs) // 2 - 1] + probs[len(probs) // 2]) / 2  # about half abstain
    strict = tmp_path / "strict.yaml"
    head = out.parent / "fitted.head.safetensors"
    strict.write_text(out.read_text().replace("head: fitted.head.safetensors", f"head: {head}") + f"threshold: {cut}\n")
    answers = tmp_path / "answers.jsonl"
    assert invoke("run", strict, pool, "-o", answers, "-q", "--gold", "").exit_code == 0
    records = {r["id"]: r for r in map(json.loads, answers.read_text().splitlines())}
    answered = {k for k, r in records.items() if r["label"] is not None}
    assert 0 < len(answered) < len(records)
    audit = tmp_path / "audit.csv"
    result = invoke("suggest", strict, pool, "--audit", answers, "-n", "10", "-o", audit)
    assert result.exit_code == 0, result.output
    assert "loading the model" not in result.stderr and "picked_by: audit" in result.stderr
    assert f"{len(records) - len(answered)} it abstained on" in result.stderr
    rows = _read(audit)
    assert len(rows) == min(10, len(answered)) and {r["id"] for r in rows} <= answered
    assert {r["picked_by"] for r in rows} == {"audit"} and all(r["gold"] == "" for r in rows)
    for r in rows:  # a person labels them: the head's own answer, one of them flipped
        r["gold"] = records[r["id"]]["label"]
    rows[0]["gold"] = next(label for label in LABELS if label != rows[0]["gold"])
    labelled = _write(tmp_path / "audit.jsonl", rows)
    result = invoke("run", strict, labelled, "-o", tmp_path / "check.jsonl", "--metrics", tmp_path / "m.json",
                    "--min-answered-accuracy", "0.9")
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["answered_accuracy"] == pytest.approx((len(rows) - 1) / len(rows)), metrics
    assert metrics["answered_accuracy_low"] < 0.9 and metrics["min_answered_accuracy"] == 0.9
    assert result.exit_code == 5 and "below --min-answered-accuracy 0.9" in result.stderr, result.output
    every = invoke("suggest", out, pool, "--audit", first, "-n", "5", "-o", tmp_path / "every.csv")  # no cut: all answered
    assert every.exit_code == 0 and "suggested 5 of the 40 items the run answered (0 it abstained" in every.stderr
    result = invoke("suggest", strict, pool, "--audit", answers, "--random", "-n", "3", "-o", tmp_path / "x.csv")
    assert result.exit_code == 2 and "give one" in result.stderr
    other = _write(tmp_path / "other.jsonl", [{**r, "text": r["text"] + " edited"} for r in _rows(40, start=400, gold=False)])
    result = invoke("suggest", strict, other, "--audit", answers, "-n", "3", "-o", tmp_path / "y.csv")
    assert result.exit_code != 0 and "give that run's input as POOL" in result.stderr
    # an audit is of this spec's run, as the run wrote it
    result = invoke("suggest", strict, pool, "--audit", first, "-n", "3", "-o", tmp_path / "z.csv")
    assert result.exit_code == 2 and "written by a run of another spec" in result.stderr, result.output
    lines = answers.read_text().splitlines(keepends=True)
    edits = {"twice": lines + lines[:1],
             "labelled": [line.replace('"label": null', f'"label": "{LABELS[0]}"') for line in lines]}
    for name, edited in edits.items():
        copy = tmp_path / f"{name}.jsonl"
        copy.write_text("".join(edited))
        (tmp_path / f"{name}.jsonl.prefixcache.json").write_bytes((tmp_path / "answers.jsonl.prefixcache.json").read_bytes())
        result = invoke("suggest", strict, pool, "--audit", copy, "-n", "3", "-o", tmp_path / f"{name}.csv")
        assert result.exit_code == 2 and "changed after the run wrote it" in result.stderr, (name, result.output)
