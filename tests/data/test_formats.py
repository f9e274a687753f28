"""More inputs, read lazily: TSV, a JSON array, gzip-compressed text, Parquet; CSV delimiter and
encoding. The same items give the same records whatever the format."""

from __future__ import annotations

import csv
import gzip
import json
import sys

import pytest
from helpers import invoke, records, write_spec

from prefixcache.errors import InputError
from prefixcache.data.items import read_items

ROWS = [{"id": f"f{k}", "text": t, "n": str(k)} for k, t in enumerate(
    ["crash on start", "refund, please", 'said "hi"\nthen left', "é accented", "x" * 300])]


def _write_all(tmp_path) -> dict[str, object]:
    files = {}
    files["jsonl"] = tmp_path / "in.jsonl"
    files["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    files["json"] = tmp_path / "in.json"
    files["json"].write_text(json.dumps(ROWS, indent=2))  # objects over several lines each
    files["jsonl.gz"] = tmp_path / "in.jsonl.gz"
    files["jsonl.gz"].write_bytes(gzip.compress(files["jsonl"].read_bytes()))
    for name, delimiter in (("csv", ","), ("tsv", "\t")):
        files[name] = tmp_path / f"in.{name}"
        with files[name].open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["id", "text", "n"], delimiter=delimiter)
            writer.writeheader()
            writer.writerows(ROWS)
    files["csv.gz"] = tmp_path / "in.csv.gz"
    files["csv.gz"].write_bytes(gzip.compress(files["csv"].read_bytes()))
    import pyarrow as pa
    import pyarrow.parquet as pq

    files["parquet"] = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), files["parquet"], row_group_size=2)
    return files


def test_every_format_reads_the_same_items(tmp_path):
    for fmt, path in _write_all(tmp_path).items():
        items = list(read_items(str(path)))
        assert [dict(i.record) for i in items] == ROWS, fmt
        assert [i.id for i in items] == [r["id"] for r in ROWS]
    assert [i.line for i in read_items(str(tmp_path / "in.json"))] == [2, 7, 12, 17, 22]  # where each object starts


def test_every_format_gives_the_same_records(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"])
    outputs = {}
    for fmt, path in _write_all(tmp_path).items():
        out = tmp_path / f"out-{fmt}.jsonl"
        result = invoke("run", spec, path, "-o", out, "-q", "--keep", "n")
        assert result.exit_code == 0, (fmt, result.output)
        outputs[fmt] = records(out)
    first = outputs.pop("jsonl")
    for fmt, written in outputs.items():
        assert written == first, fmt


def test_delimiter_and_encoding(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes("id;text\n1;caf\xe9 cr\xe8me\n".encode("latin-1"))
    with pytest.raises(InputError, match="not valid UTF-8"):
        list(read_items(str(path)))
    [item] = read_items(str(path), delimiter=";", encoding="latin-1")
    assert item.record == {"id": "1", "text": "café crème"}


def test_every_command_that_reads_items_takes_the_input_options(tmp_path, tiny_model_dir):
    """run, render and bench read a `;`-separated latin-1 CSV the same way (one declaration)."""
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"])
    path = tmp_path / "in.csv"
    path.write_bytes("id;text\n1;caf\xe9 cr\xe8me\n2;th\xe9\n".encode("latin-1"))
    read = ("--delimiter", ";", "--encoding", "latin-1")
    rendered = invoke("render", spec, path, *read)
    assert rendered.exit_code == 0, rendered.output
    assert [json.loads(line)["id"] for line in rendered.stdout.splitlines()] == ["1", "2"]
    assert "café crème" in json.loads(rendered.stdout.splitlines()[0])["prompt"]
    ran = invoke("run", spec, path, *read, "-q")
    assert ran.exit_code == 0 and [json.loads(line)["id"] for line in ran.stdout.splitlines()] == ["1", "2"]
    import typer

    from prefixcache.cli import app

    # bench reads its items through the same function as render, so it needs only the same options
    bench = typer.main.get_command(app).commands["bench"]
    assert {"--delimiter", "--encoding", "--format"} <= {name for param in bench.params for name in param.opts}
    unread = invoke("render", spec, path)  # without them: read as UTF-8, refused with the option to give
    assert unread.exit_code == 2 and unread.stderr == f"error: {path}:2: not valid UTF-8 (byte 6 of the line; see --encoding)\n"


def test_a_broken_json_array_names_its_line(tmp_path):
    path = tmp_path / "in.json"
    path.write_text('[\n  {"id": 1, "text": "a"},\n  {"id": 2, "text": oops}\n]\n')
    with pytest.raises(InputError, match=r"in.json:3: malformed JSON"):
        list(read_items(str(path)))
    path.write_text('{"id": 1}')
    with pytest.raises(InputError, match=r"in.json:1: a .json input is one JSON array of objects"):
        list(read_items(str(path)))


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "in.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(InputError, match=r"reading Parquet needs pyarrow: pip install 'prefixcache\[parquet\]'"):
        list(read_items(str(path)))


def test_a_bad_byte_is_reported_on_its_own_line(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b"id,text\n1,a\n2,b\n3,c\n4,caf\xe9\n")
    with pytest.raises(InputError) as refused:
        list(read_items(str(path)))
    assert str(refused.value) == f"{path}:5: not valid UTF-8 (byte 6 of the line; see --encoding)"


def test_a_semicolon_csv_read_with_commas_suggests_the_delimiter(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"])
    path = tmp_path / "in.csv"
    path.write_text("id;text\n1;hello\n")
    result = invoke("run", spec, path)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {path}:2: item 1 lacks field 'text' used by the template (its fields: 'id;text'); "
                             f"the header looks ';'-separated: give --delimiter ';'\n")


def test_a_semicolon_csv_whose_text_holds_commas_suggests_the_delimiter(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("id;text\n1;clear, and loud\n")
    with pytest.raises(InputError) as refused:
        list(read_items(str(path)))
    assert str(refused.value) == f"{path}:2: expected 1 columns, found 2; the header looks ';'-separated: give --delimiter ';'"
