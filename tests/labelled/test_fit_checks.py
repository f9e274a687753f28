"""What fit, suggest and run refuse before the model loads, in one line: a labelled item or a
prefix the model's context cannot hold (the tokenizer and the model's config know), an empty
pool, --exact on llama.cpp."""

from __future__ import annotations

import json

from helpers import invoke, write_spec

LABELS = ["billing", "technical"]


def _labelled(tmp_path, rows):
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n=12):
    return [{"id": f"i{k}", "text": f"{'invoice' if k % 2 else 'crash'} number {k}",
             "gold": LABELS[k % 2]} for k in range(n)]


def test_an_item_or_a_prefix_beyond_the_context_is_refused_before_the_model_loads(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS, gold="gold")
    huge = _labelled(tmp_path, _rows() + [{"id": "huge", "text": "word " * 3000, "gold": "billing"}])
    result = invoke("fit", spec, huge, "-o", tmp_path / "f.yaml")
    assert result.exit_code == 4, result.output
    assert "item 'huge'" in result.stderr and "do not fit the model's context of 1024" in result.stderr
    assert "loading the model" not in result.stderr
    long_spec = write_spec(tmp_path, name="long.yaml", model=str(tiny_model_dir), labels=LABELS, gold="gold",
                           system="Sort the ticket. " * 400)
    result = invoke("fit", long_spec, _labelled(tmp_path, _rows()), "-o", tmp_path / "g.yaml")
    assert result.exit_code == 3, result.output
    assert "the static prompt prefix has" in result.stderr and "model's context of 1024" in result.stderr
    assert "loading the model" not in result.stderr


def test_an_empty_pool_is_said_as_such(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS)
    empty = tmp_path / "pool.jsonl"
    empty.write_text("")
    result = invoke("suggest", spec, empty, "-n", "3", "-o", tmp_path / "s.csv")
    assert result.exit_code == 2 and "the pool holds no items: nothing to suggest" in result.stderr


def test_exact_on_llama_cpp_is_refused_for_what_it_is(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS)
    items = _labelled(tmp_path, _rows(2))
    result = invoke("run", spec, items, "-o", tmp_path / "o.jsonl", "--backend", "llama.cpp", "--exact")
    assert result.exit_code == 2 and "llama.cpp has no float32 twin" in result.stderr
    assert "give --dtype" not in result.stderr
