"""Data in and out the way data people work: kept input columns, the output format chosen apart
from the input's, the id column under its own name."""

from __future__ import annotations

import csv
import io
import json

import pytest
from helpers import invoke, write_spec


@pytest.fixture()
def reviews(tmp_path):
    path = tmp_path / "reviews.csv"
    rows = [("r1", "Great", "Sound is clear, battery lasts.", "5"), ("r2", "Broken", "Stopped after two days.", "1"),
            ("r3", "Fine", 'It does what it says; "ok".', "3")]
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([("review_id", "title", "body", "rating"), *rows])
    return path


@pytest.fixture()
def spec_path(spec_file):
    return spec_file(labels=["positive", "negative"], template="{title}. {body}", id_field="review_id")


def test_kept_columns_in_csv_need_no_join(spec_path, reviews, tmp_path):
    out = tmp_path / "out.csv"
    result = invoke("run", spec_path, reviews, "-o", out, "--keep", "title,rating", "-q")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0])[:4] == ["review_id", "title", "rating", "label"]  # the id under its input name
    assert [(r["review_id"], r["title"], r["rating"]) for r in rows] == [("r1", "Great", "5"), ("r2", "Broken", "1"),
                                                                        ("r3", "Fine", "3")]
    again = invoke("run", spec_path, reviews, "-o", out, "--keep", "title,rating", "--resume")  # read back fine
    assert again.exit_code == 0 and "nothing to do" in again.stderr


@pytest.mark.parametrize("first, then, named", [
    (("--keep", "title,rating"), ("--keep", "title"), "--keep title,rating"),
    (("--keep", "title"), (), "--keep title"),
    ((), ("--keep", "title"), "no --keep"),
    (("--keep-all",), (), "--keep title,body,rating"),  # a file's fields, as --keep-all found them
])
def test_a_resume_refused_for_kept_fields_names_the_option(spec_path, reviews, tmp_path, first, then, named):
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec_path, reviews, "-o", out, "-n", 1, *first, "-q").exit_code == 0
    refused = invoke("run", spec_path, reviews, "-o", out, *then, "--resume", "-q")
    assert refused.exit_code == 2
    assert refused.stderr == (f"error: {out}: cannot continue it: it was written with {named}; add it back to "
                              f"continue it, or choose another output file\n")


def test_keep_all_in_jsonl_keeps_values_as_they_were(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"])
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 7, "text": "x", "meta": {"tags": ["p", "q"]}, "n": 2.5}) + "\n")
    result = invoke("run", spec, src, "--keep-all", "-q")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert list(record)[:5] == ["id", "text", "meta", "n", "label"]
    assert record["meta"] == {"tags": ["p", "q"]} and record["n"] == 2.5
    as_csv = invoke("run", spec, src, "--keep-all", "-q", "--output-format", "csv")  # CSV on stdout
    assert as_csv.exit_code == 0, as_csv.output
    [row] = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert row["meta"] == '{"tags": ["p", "q"]}' and row["n"] == "2.5" and row["id"] == "7"


@pytest.mark.parametrize("args,message", [
    (["--keep", "label"], "cannot keep input field 'label': 'label' is a field of the record itself; rename it in the input"),
    (["--keep", "titel"], "--keep titel: no item has this field; the items' fields are 'review_id', 'title', 'body', 'rating'"),
    (["--keep", "title", "--keep-all"], "give --keep FIELD,... or --keep-all, not both"),
    (["-o", "{tmp}/out.csv", "--output-format", "jsonl"], "{tmp}/out.csv: --output-format jsonl contradicts the file's extension"),
    (["--format", "jsonl"], "{src}: --format jsonl contradicts the file's extension"),
])
def test_refused_before_the_model_loads(spec_path, reviews, tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    result = invoke("run", spec_path, reviews, *args)
    assert result.exit_code == 2
    assert result.stderr == "error: " + message.format(tmp=tmp_path, src=reviews) + "\n"


def test_a_field_named_like_a_label_column_is_a_clash(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"])
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "text": "x", "prob_a": 1}) + "\n")
    result = invoke("run", spec, src, "--keep-all")
    assert result.exit_code == 2 and "'prob_a' is named like the record's per-label CSV columns" in result.stderr


def test_dry_run_counts_tokens_estimates_and_writes_nothing(spec_path, reviews, tmp_path):
    out = tmp_path / "out.jsonl"
    result = invoke("run", spec_path, reviews, "-o", out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert not out.exists() and not (tmp_path / "out.jsonl.prefixcache.json").exists()
    counts = [json.loads(line) for line in result.stdout.splitlines()]
    assert [c["id"] for c in counts] == ["r1", "r2", "r3"] and all(c["item_tokens"] > 3 for c in counts)
    rendered = [json.loads(line) for line in invoke("render", spec_path, reviews).stdout.splitlines()]
    assert [c["item_tokens"] for c in counts] == [len(r["prompt_ids"]) - r["prefix_len"] for r in rendered]
    [memory, summary, estimate] = result.stderr.splitlines()  # the model's memory is said before it loads
    assert "prefixcache: memory: " in memory and " will take about " in memory
    total = sum(c["item_tokens"] for c in counts)
    assert summary.startswith(f"dry run: 3 items to score · prefix {rendered[0]['prefix_len']} tokens, encoded once · "
                              f"{total} item tokens")
    assert estimate.startswith("measured on 3 items: ") and estimate.endswith("nothing was written")


def test_dry_run_of_a_resume_refuses_what_the_run_refuses_and_counts_what_is_left(spec_path, reviews, tmp_path):
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec_path, reviews, "-o", out, "-n", 2, "-q").exit_code == 0
    result = invoke("run", spec_path, reviews, "-o", out, "--resume", "--dry-run")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == ["r3"]
    assert "the output holds 2 items already; resumed, the run scores the rest · 1 items to score" in result.stderr, result.stderr
    (tmp_path / "out.jsonl.prefixcache.json").unlink()
    dry = invoke("run", spec_path, reviews, "-o", out, "--resume", "--dry-run")
    real = invoke("run", spec_path, reviews, "-o", out, "--resume")
    assert dry.exit_code == real.exit_code == 2 and "the fingerprint of the run that wrote it) is missing" in dry.stderr
    assert dry.stderr.splitlines()[-1].split(": ", 1)[1] == real.stderr.splitlines()[-1].split(": ", 1)[1]


def test_dry_run_on_stdin_reads_it_once_and_measures(spec_path, reviews, tmp_path):
    result = invoke("run", spec_path, "-", "--format", "csv", "--dry-run", input=reviews.read_text())
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == ["r1", "r2", "r3"]
    assert result.stderr.splitlines()[2].startswith("measured on 3 items: ")


def test_output_format_names_the_format_of_an_output_whose_extension_does_not(spec_path, reviews, tmp_path):
    out = tmp_path / "predictions.txt"
    written = invoke("run", spec_path, reviews, "-o", out, "-F", "csv", "-n", 2, "-q")
    assert written.exit_code == 0, written.output
    assert next(csv.reader(out.open()))[:2] == ["review_id", "label"]
    resumed = invoke("run", spec_path, reviews, "-o", out, "-F", "csv", "--resume", "-q")
    assert resumed.exit_code == 0, resumed.output
    assert [r["review_id"] for r in csv.DictReader(out.open())] == ["r1", "r2", "r3"]
    unnamed = invoke("run", spec_path, reviews, "-o", tmp_path / "other.txt")
    assert unnamed.exit_code == 2
    assert unnamed.stderr == f"error: {tmp_path / 'other.txt'}: output must end in .jsonl or .csv, or give --output-format jsonl|csv\n"
