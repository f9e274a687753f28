"""Inputs and specs that are wrong, strange or hostile: each is one typed error naming the file
and line (never a traceback, never unbounded memory), or read as it is meant."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
import pytest
from helpers import invoke, write_spec
from prefixcache.errors import InputError, SpecError
from prefixcache.data.items import scan_items
from prefixcache.task.specfile import load_spec
import threading
from helpers import records as _records
from helpers import LABELS3, items_file, json_lines, refund_items_file, write_jsonl


def _fuzz_lines(rng: random.Random) -> bytes:
    pieces = [b'{"id": 1, "text": "x"}', b"{", b"}", b"[", b"]", b'"', b"\\", b"\\ud800", b"\\u0000", b"\xff\xfe",
              b"\xef\xbb\xbf", b"\n", b"\r\n", b",", b":", b"null", b"1e999", b"-0", b'"id"', b'"text"', b"\t",
              b"\xe2\x80\xa8", b"'", b"a,b\n", b'"unterminated', b"\x00", b"{" * 50, b"]" * 50]
    return b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))


# -- bad input is an error with its file and line, never an internal error -------------------
def _parquet(path: Path, **columns) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize("content,message", [
    ('{"id": 1, "text": ' + "[" * 5000 + "]" * 5000 + "}\n", "in.jsonl:1: JSON nested too deeply"),
    ('{"id": "a", "text": "ok"}\n{"id": "b", "text": "half \\ud800 pair"}\n',
     "in.jsonl:2: contains an unpaired surrogate escape (like \\ud800), which is not text"),
    ('{"id": "\\udfff", "text": "x"}\n', "in.jsonl:1: contains an unpaired surrogate escape (like \\ud800), which is not text"),
])
@pytest.mark.parametrize("command", ["run", "render"])
def test_hostile_json_is_one_line(spec_path, tmp_path, content, message, command):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    result = invoke(command, spec_path, src)
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path}/{message}\n"


def test_deeply_nested_yaml_spec(tmp_path):
    spec = tmp_path / "deep.yaml"
    spec.write_text("labels: " + "[" * 5000 + "]" * 5000 + "\n")
    result = invoke("run", spec, items_file(tmp_path))
    assert result.exit_code == 2 and result.stderr == f"error: {spec}: YAML nested too deeply\n"


def test_an_item_far_longer_than_the_context_is_refused_before_tokenising(spec_path, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "big", "text": "word " * 200_000}) + "\n" + json.dumps({"id": "ok", "text": "x"}) + "\n")
    out = tmp_path / "o.jsonl"
    result = invoke("run", spec_path, src, "-o", out, "--on-error", "skip", "-q")
    assert result.exit_code == 4
    [big, ok] = [json.loads(line) for line in out.read_text().splitlines()]
    assert big["error"] == "item 'big': its fields hold 1000000 characters, far more than the model's context of 1024 tokens"
    assert ok["label"] in ("tech", "billing")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv", "json"])
def test_readers_never_fail_with_anything_but_an_input_error(tmp_path, fmt):
    """A seeded fuzz of the readers: whatever the bytes, a clean scan or one InputError."""
    rng = random.Random(1234)
    path = tmp_path / f"fuzz.{fmt}"
    outcomes = {"clean": 0, "refused": 0}
    for _ in range(400):
        path.write_bytes(_fuzz_lines(rng))
        try:
            scan_items(str(path), fmt, "id", lambda record: None)
            outcomes["clean"] += 1
        except InputError as exc:
            assert str(exc).startswith(str(path)), exc  # the error names the file
            outcomes["refused"] += 1
    # the fuzz reaches both ends (random pieces never make a whole strict JSON array: one is added)
    if fmt == "json":
        path.write_bytes(b'[{"id": 1}, {"id": 2}]')
        outcomes["clean"] += scan_items(str(path), fmt, "id", lambda record: None) == 2
    assert outcomes["clean"] and outcomes["refused"], outcomes


def test_spec_loader_never_fails_with_anything_but_a_spec_error(tmp_path):
    rng = random.Random(99)
    pieces = ["labels:", " [a, b]", "\n", "system: ", "'", '"', "{", "}", "&x", "*x", "!!python/object:os.system", ":",
              "- ", "  ", "template: '{text}'", "examples:", "\n  - text: x\n    label: a", "\t", "\x00", "{{", "%",
              "normalize: mean", "choices: c", "threshold: 2", "calibrate: [1]", "id_field: ''", "model: ./nowhere"]
    path = tmp_path / "fuzz.yaml"
    outcomes = {"clean": 0, "refused": 0}
    for _ in range(400):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 25)))
        path.write_text(body if rng.random() < 0.8 else "labels: [a, b]\n" + body.replace("labels:", "x:"))
        try:
            load_spec(path)
            outcomes["clean"] += 1
        except SpecError as exc:
            assert str(exc).startswith(str(path)), exc
            outcomes["refused"] += 1
    assert outcomes["clean"] and outcomes["refused"], outcomes


def test_damaged_parquet_files_are_input_errors(tmp_path):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    whole = _parquet(tmp_path / "whole.parquet", id=[1, 2], text=["a", "b"]).read_bytes()
    for name, data in (("empty", b""), ("truncated", whole[: len(whole) // 2]), ("garbage", b"PAR1" + b"x" * 99 + b"PAR1")):
        (tmp_path / f"{name}.parquet").write_bytes(data)
        with pytest.raises(InputError, match=f"{name}.parquet: cannot read it as Parquet"):
            list(read_items(str(tmp_path / f"{name}.parquet")))


def test_parquet_dates_decimals_bytes_and_nan_become_json_values(tmp_path, tiny_model_dir):
    import datetime
    import decimal

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3, template="{text} on {day}")
    items = _parquet(tmp_path / "i.parquet", id=[1], text=["refund"], day=[datetime.date(2026, 12, 3)],
                     at=[datetime.datetime(2026, 12, 3, 9, 30)], amount=[decimal.Decimal("12.50")], raw=[b"\xff\x00"],
                     score=[float("nan")])
    out = tmp_path / "o.jsonl"
    result = invoke("run", spec, items, "-o", out, "--keep-all", "-q")
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert (record["day"], record["at"], record["amount"], record["raw"], record["score"]) == (
        "2026-12-03", "2026-12-03T09:30:00", "12.50", "/wA=", None)


@pytest.mark.parametrize("content, message", [
    (b'{"id": 1, "n": ' + b"9" * 5000 + b"}\n", "more than 4300 digits"),
    (b'{"id": 1, "n": NaN}\n', "NaN is not a JSON value"),
    (b'{"id": 1, "n": -Infinity}\n', "-Infinity is not a JSON value"),
])
def test_numbers_json_does_not_have_are_refused_with_the_line(tmp_path, content, message):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    (tmp_path / "i.jsonl").write_bytes(b'{"id": 0}\n' + content)
    with pytest.raises(InputError, match=f"i.jsonl:2: .*{message}"):
        list(read_items(str(tmp_path / "i.jsonl")))


@pytest.mark.parametrize("text, message", [
    ('[{"id": 1} {"id": 2}]', "expected ',' or ']' after an object, found '{'"),
    ('[{"id": 1}', "found the end of the file"),
    ('[{"id": 1}] trailing', "data after the end of the array"),
    ('[{"id": 1},]', "malformed JSON"),
])
def test_a_json_array_input_is_strict_json(tmp_path, text, message):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    (tmp_path / "i.json").write_text(text)
    with pytest.raises(InputError, match=re.escape(message)):
        list(read_items(str(tmp_path / "i.json")))


def test_a_damaged_gzip_stream_is_an_input_error(tmp_path):
    import gzip

    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    data = gzip.compress(b"".join(json.dumps({"id": k, "text": "x" * 50}).encode() + b"\n" for k in range(3000)))
    for cut in (data[: len(data) // 2], data[:100] + bytes(200) + data[300:]):
        (tmp_path / "i.jsonl.gz").write_bytes(cut)
        with pytest.raises(InputError, match="i.jsonl.gz"):
            list(read_items(str(tmp_path / "i.jsonl.gz")))


# -- messages that say what happened ---------------------------------------------------------
def test_an_id_met_twice_says_which_item_was_numbered(tmp_path):
    from prefixcache.data.items import scan_items
    from prefixcache.errors import InputError

    path = tmp_path / "i.jsonl"
    path.write_text('{"text": "a"}\n{"id": 1, "text": "b"}\n')
    with pytest.raises(InputError, match=r"i.jsonl:2: id 1 is given twice: the item on line 1, which has no 'id' "
                                         r"and is numbered 1 by its position"):
        scan_items(str(path), "jsonl", "id", lambda record: None)


def test_an_empty_model_is_refused_with_the_key(tmp_path):
    spec = write_spec(tmp_path, labels=LABELS3, model="")
    result = invoke("run", spec, refund_items_file(tmp_path / "i.jsonl", 1))
    assert result.exit_code == 2 and "'model' is empty" in result.output, result.output


# -- memory stays bounded ----------------------------------------------------------------------
@pytest.mark.parametrize("command", [("render",), ("run", "--dry-run")])
def test_an_item_far_longer_than_the_context_is_refused_before_tokenising_from_the_cli(tmp_path, tiny_model_dir, command):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "i.jsonl"
    ordinary = "".join(json.dumps({"id": k, "text": "refund"}) + "\n" for k in range(20))  # the dry run measures these
    items.write_text(ordinary + json.dumps({"id": 99, "text": "refund " * 40_000}) + "\n")  # 280 000 characters
    result = invoke(*command[:1], spec, items, *command[1:])
    assert result.exit_code == 4 and "far more than the model's context of 1024 tokens" in result.output, result.output


def test_a_huge_option_is_refused_before_tokenising(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=None, choices="options", template="Q: {text}")
    items = tmp_path / "i.jsonl"
    items.write_text(json.dumps({"id": 1, "text": "which?", "options": ["a", "b" * 100_000]}) + "\n")
    result = invoke("render", spec, items)
    assert result.exit_code == 4 and "far more than the model's context" in result.output, result.output


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_an_endless_line_is_an_error_not_unbounded_memory(tmp_path, fmt):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    with pytest.raises(InputError, match="a line longer than 64 MiB"):
        next(read_items("/dev/zero", fmt))


def test_a_fifo_given_as_a_path_is_read_once_not_as_empty(spec_path, tmp_path):
    fifo = tmp_path / "items.jsonl"
    os.mkfifo(fifo)
    data = "".join(json.dumps({"id": f"p{k}", "text": f"ticket {k}"}) + "\n" for k in range(5))
    writer = threading.Thread(target=lambda: fifo.write_text(data))
    writer.start()
    out = tmp_path / "out.jsonl"
    result = invoke("run", spec_path, fifo, "-o", out, "-q")
    writer.join()
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in json_lines(out)] == [f"p{k}" for k in range(5)]


def test_an_auto_numbered_id_and_a_written_one_are_duplicates(spec_path, tmp_path):
    numbered = tmp_path / "numbered.jsonl"
    numbered.write_text('{"text": "first"}\n{"id": "1", "text": "clash with the first one\'s number"}\n')
    assert "id '1' is given twice: the item on line 1, which has no 'id'" in invoke("run", spec_path, numbered).stderr


@pytest.mark.parametrize("text,message", [
    ("labels: &a [x, y]\nexamples: [{text: *a, label: x}]\n", "YAML alias *a is not allowed in a spec; write the value out"),
    ("labels: [a, b]\nlabels: [c, d]\n", "key 'labels' is given twice"),
    ("labels: [yes, no]\n", "label True is how YAML reads an unquoted yes/no/true/false/on/off; quote the label, e.g. \"yes\""),
])
def test_spec_yaml_traps(tmp_path, text, message):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as refused:
        load_spec(path)
    assert str(refused.value).endswith(message)


def test_empty_input_is_an_empty_output(spec_four_labels, tmp_path):
    for name in ("empty.jsonl", "empty.csv"):
        src = tmp_path / name
        src.write_text("")
        out = tmp_path / ("out-" + name)
        result = invoke("run", spec_four_labels, src, "-o", out)
        assert result.exit_code == 0, result.output
        assert "prefixcache: done: 0 records to" in result.stderr.splitlines()[-1]
        assert out.read_text() == ("" if name.endswith("jsonl") else out.read_text().splitlines()[0] + "\n")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", b'{"id": 1, "text": "ok"}\n{"id": 2, "text": oops}\n',
         "{path}:2: malformed JSON: Expecting value (column 19)"),
        ("bad.jsonl", b'{"id": 1, "text": "ok"}\n{"id": 2, "text": "\xff"}\n',
         "{path}:2: not valid UTF-8 (byte 20 of the line)"),
        ("bad.jsonl", b'{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n', "{path}:2: duplicate id 1 (first on line 1)"),
        ("bad.csv", b"id,text\n1,a,b\n", "{path}:2: expected 2 columns, found 3"),
        ("bad.csv", b'id,text\nc1,"never closed\nc2,x\nc3,y\n', "{path}:2: a quoted field opened in this row is never closed"),
        ("bad.jsonl", b'{"id": "n", "text": null}\n', "{path}:1: item 'n' has no value in field 'text' (used by the template): null"),
        ("blank.csv", b'id,text\nc1,hello\nc2,\n', "{path}:3: item 'c2' has nothing to classify: its 'text' is empty"),
        ("bad.jsonl", b'{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n', "{path}:2: duplicate id '1' (first on line 1)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(spec_four_labels, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    result = invoke("run", spec_four_labels, path, "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2
    assert result.stderr == "error: " + message.format(path=path) + "\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_quirky_csv_works(spec_four_labels, tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes('\ufeffid,text\n1,"crash, again"\n2,"refund\nplease"\n'.encode())
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec_four_labels, path, "-o", out, "-q").exit_code == 0
    assert [r["id"] for r in _records(out)] == ["1", "2"]


def test_a_misspelt_id_field_is_refused_before_the_model_loads(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"], id_field="reviewid")
    src = write_jsonl(tmp_path / "in.jsonl", [{"review_id": 1, "text": "x"}, {"review_id": 2, "text": "y"}])
    result = invoke("run", spec, src)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {src}: no item has the id field 'reviewid' set by the spec's 'id_field'; "
                             "the items' fields are 'review_id', 'text'\n")

