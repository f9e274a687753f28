"""Lazy readers and streaming writers."""

from __future__ import annotations

import json

import pytest

from prefixcache.errors import InputError
from prefixcache.data.items import read_items, scan_items
from prefixcache.data.output import open_writer


def test_jsonl_ids_and_numbering(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n\n{"text": "y"}\n{"id": 7, "text": "z"}\n')
    items = list(read_items(str(path)))
    assert [(i.id, i.line) for i in items] == [("a", 1), (2, 3), (7, 4)]


@pytest.mark.parametrize("name,content,message", [
    ("in.jsonl", b'{"text": "x"}\n{"text": \n', "malformed JSON"),
    ("in.jsonl", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "not valid UTF-8"),
    ("in.csv", b"id,text\n1,a,b\n", "expected 2 columns, found 3"),
])
def test_a_bad_line_is_named(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputError, match=rf"^{path}:2: {message}"):
        list(read_items(str(path)))


def test_csv_with_bom_quoted_commas_and_newlines(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes('\ufeffid,text\n1,"a, b"\n2,"line one\nline two"\n3,plain\n'.encode("utf-8"))
    items = list(read_items(str(path)))
    assert [i.record["text"] for i in items] == ["a, b", "line one\nline two", "plain"]
    assert [i.id for i in items] == ["1", "2", "3"] and [i.line for i in items] == [2, 3, 5]


def test_empty_file_gives_no_items(tmp_path):
    for name in ("e.jsonl", "e.csv"):
        (tmp_path / name).write_text("")
        assert list(read_items(str(tmp_path / name))) == []


def test_format_needed_for_stdin_and_unknown_extension(tmp_path):
    with pytest.raises(InputError, match="needs an explicit format"):
        list(read_items("-"))
    with pytest.raises(InputError, match="cannot tell the format"):
        list(read_items(str(tmp_path / "x.txt")))
    with pytest.raises(InputError, match="input file not found"):
        list(read_items(str(tmp_path / "missing.jsonl")))


def test_scan_checks_fields_and_duplicate_ids(tmp_path):
    from helpers import make_spec

    check = make_spec(tmp_path).check_record
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "text": "x"}\n{"id": 2, "body": "y"}\n')
    with pytest.raises(InputError, match=rf"^{path}:2: item 2 lacks field 'text' used by the template \(its fields: 'id', 'body'\)$"):
        scan_items(str(path), None, "id", check)
    path.write_text('{"id": 1, "text": "x"}\n{"id": 1, "text": "y"}\n')
    with pytest.raises(InputError, match=rf"^{path}:2: duplicate id 1 \(first on line 1\)$"):
        scan_items(str(path), None, "id", check)
    path.write_text('{"id": 1, "text": "x"}\n{"id": 2, "text": "y"}\n')
    assert scan_items(str(path), None, "id", check) == 2


def test_writers_flush_each_record(tmp_path):
    out = tmp_path / "o.jsonl"
    w = open_writer(str(out))
    w.write({"id": 1, "probs": {"a": 0.5}})
    assert json.loads(out.read_text()) == {"id": 1, "probs": {"a": 0.5}}  # readable before close
    w.close()
    out = tmp_path / "o.csv"
    w = open_writer(str(out), ["id", "label"])
    w.write({"id": 1, "label": "a, b"})
    assert out.read_text() == 'id,label\n1,"a, b"\n'
    w.close()
