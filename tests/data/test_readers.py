"""Readers: what an input's bytes become, and the one-line errors for what they cannot."""

from __future__ import annotations

import json

import pytest

from helpers import invoke, write_spec


@pytest.mark.parametrize("name, data, encoding, message", [
    ("a.csv", "id,text\n1,hello\n".encode("utf-16-le"), "utf-16", "give the byte order (--encoding utf-16-le"),
    ("a.csv", b"id,text\n1,hello\n", "rot13", "--encoding 'rot13': no such text encoding"),
    ("a.csv", b"id,text\n1,hello\n", "hex", "--encoding 'hex': no such text encoding"),
    ("a.jsonl", b'{"id": 1, "text": "hello"}\n', "latin-1", "applies to CSV and TSV inputs"),
])
def test_an_encoding_that_cannot_read_the_input_is_one_line_and_exit_2(tmp_path, tiny_model_dir, name, data, encoding, message):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"]), tmp_path / name
    items.write_bytes(data)
    for command in ("run", "render"):
        result = invoke(command, spec, items, "--encoding", encoding, *(["-o", tmp_path / "o.jsonl"] if command == "run" else []))
        assert result.exit_code == 2 and message in result.output and "internal error" not in result.output, result.output


def test_utf16_with_its_byte_order_reads(tmp_path, tiny_model_dir):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"]), tmp_path / "a.csv"
    items.write_bytes("id,text\n1,héllo\n".encode("utf-16-le"))
    result = invoke("render", spec, items, "--encoding", "utf-16-le", "--limit", "1")
    assert result.exit_code == 0 and "héllo" in json.loads(result.stdout.splitlines()[0])["prompt"], result.output


@pytest.mark.parametrize("data, message", [
    (b'{"id": "J1", "text": "a", "id": "J9"}\n', "{path}:1: key 'id' is given twice in one object"),
    (b'[{"id": "J1", "text": "a", "text": "b"}]', "{path}:1: key 'text' is given twice in one object"),
    (b'{"id": "n", "text": null}\n', "{path}:1: item 'n' has no value in field 'text'"),
])
def test_render_and_run_refuse_the_same_bad_item_alike(tmp_path, tiny_model_dir, data, message):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"])
    items = tmp_path / ("i.json" if data.startswith(b"[") else "i.jsonl")
    items.write_bytes(data)
    for args in (("render", spec, items), ("run", spec, items, "-o", tmp_path / "o.jsonl")):
        result = invoke(*args)
        assert result.exit_code == 2 and message.format(path=items) in result.output, (args, result.output)


def test_a_label_holding_the_gold_separator_is_refused(tmp_path):
    spec = write_spec(tmp_path, labels=["billing", "tech; support"], multi_label=True, gold="tags", gold_sep=";")
    items = tmp_path / "i.jsonl"
    items.write_text(json.dumps({"id": 1, "text": "a", "tags": "billing"}) + "\n")
    result = invoke("run", spec, items, "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 2 and "label 'tech; support' holds the gold separator ';'" in result.output, result.output


def test_diff_refuses_an_output_holding_an_item_twice(tmp_path):
    from helpers import A, write_records

    a, twice = tmp_path / "a.jsonl", tmp_path / "twice.jsonl"
    write_records(a, A)
    write_records(twice, A + A)
    result = invoke("diff", a, twice)
    assert result.exit_code == 2 and f"{twice}: holds two records for item" in result.output, result.output


def test_two_labels_scored_by_the_same_words_are_refused(tmp_path):
    from prefixcache.errors import SpecError
    from prefixcache.task.specfile import load_spec

    spec = write_spec(tmp_path, labels={"refund": {"words": ["refund", "money back"]},
                                        "billing": {"words": ["money back", "refund"]}})
    with pytest.raises(SpecError, match="labels 'refund' and 'billing' are scored by the same words"):
        load_spec(spec)


def test_an_answer_prefix_the_chat_layout_does_not_use_is_warned_about(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"], answer_prefix="Category:")
    items = tmp_path / "i.jsonl"
    items.write_text(json.dumps({"id": 1, "text": "x"}) + "\n")
    result = invoke("run", spec, items, "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 0 and "'answer_prefix' is not used" in result.stderr, result.stderr
    plain = write_spec(tmp_path, name="plain.yaml", model=str(tiny_model_dir), labels=["a", "b"],
                       answer_prefix="Category:", format="plain")
    result = invoke("run", plain, items, "-o", tmp_path / "p.jsonl")
    assert result.exit_code == 0 and "'answer_prefix' is not used" not in result.stderr, result.stderr
