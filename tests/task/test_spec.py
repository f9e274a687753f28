"""Spec validation: every mistake names the file and the key, before any model is loaded."""

from __future__ import annotations

import pytest
from helpers import ROOT, write_spec

from prefixcache.errors import SpecError
from prefixcache.task.specfile import load_spec


def _error(path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value)


def test_valid_spec_defaults(tmp_path):
    spec = load_spec(write_spec(tmp_path, labels={"billing": "money", "tech": None}))
    assert spec.model is None and spec.id_field == "id" and spec.normalize == "sum" and spec.format == "auto"
    assert spec.label_names == ("billing", "tech")
    assert spec.labels[0].description == "money" and spec.labels[1].description is None
    assert spec.template.fields == ("text",)


def test_unknown_key_names_key_and_file(tmp_path):
    path = write_spec(tmp_path, lables=["a"])
    assert _error(path) == f"{path}: unknown key 'lables'; did you mean 'labels'?"


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("system: hi\nlabels: [a, b\ntemplate: x\n")
    msg = _error(path)
    assert msg.startswith(f"{path}:3:") and "YAML syntax error" in msg


def test_missing_file(tmp_path):
    assert _error(tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: spec file not found"


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"labels": []}, "'labels' is empty"),
        ({"labels": ["a", "a"]}, "label 'a' is listed twice"),
        ({"labels": ["caf\u00e9", "cafe\u0301"]}, "the same text once spaces around them are trimmed and Unicode is"),
        ({"labels": ["Billing", " Billing "]}, "lists label 'Billing' and ' Billing ', which are the same text"),
        ({"labels": {"a": {"words": ["x y", "x y "]}}}, "lists 'x y' and 'x y ', which are the same text"),
        ({"labels": ["a", ""]}, "label '' must be a non-empty string"),
        ({"labels": "a"}, "'labels' must be a list or a mapping, got str"),
        ({"template": "{text.__class__}"}, "template field {text.__class__} is not allowed"),
        ({"template": "{text!r}"}, "template field {text!r} is not allowed"),
        ({"template": "no fields"}, "references no item field"),
        ({"template": "{text"}, "invalid template"),
        ({"normalize": "max"}, "'normalize' must be one of sum, mean, chars, bytes, pmi, got 'max'"),
        ({"examples": [{"text": "x", "label": "zzz"}]}, "example 1 has label 'zzz', which is not one of the labels"),
        ({"examples": [{"body": "x", "label": "tech"}]}, "example 1 lacks field 'text' used by the template"),
        ({"trust_remote_code": "yes"}, "'trust_remote_code' must be true or false"),
        ({"system": ["a"]}, "'system' must be a string, got list"),
    ],
)
def test_invalid_values(tmp_path, data, expected):
    path = write_spec(tmp_path, **data)
    msg = _error(path)
    assert msg.startswith(f"{path}: ") and expected in msg


def test_labels_required(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("system: hi\ntemplate: '{text}'\n")
    assert "'labels' is required" in _error(path)


def test_not_a_mapping(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("- a\n- b\n")
    assert "a spec is a YAML mapping" in _error(path)


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("system: !!python/object/apply:os.system ['echo hacked']\nlabels: [a]\n")
    assert "YAML" in _error(path)


SHIPPED = [
    ("support-tickets", "tickets.jsonl", 24),
    ("support-tickets", "tickets.csv", 24),
    ("support-tickets-64-shot", "tickets.jsonl", 24),
    ("sentiment", "reviews.jsonl", 6),
    ("news-topics", "headlines.jsonl", 16),
    ("irony", "irony.jsonl", 99),
    ("general-knowledge", "general_knowledge.jsonl", 70),
    ("reading-comprehension", "passages.jsonl", 8),
    ("science-exam", "science_exam.jsonl", 8),
    ("review-aspects", "review_aspects.jsonl", 48),
    ("irony-words", "irony.jsonl", 99),
    ("banking-intents", "banking_intents.jsonl", 212),
    ("support-emails", "support_emails.jsonl", 46),
]


@pytest.mark.parametrize("config,sample,count", SHIPPED)
def test_shipped_configs_accept_their_samples(config, sample, count):
    """What `run` checks before loading a model, on every config and sample the project ships."""

    from prefixcache.data.items import scan_items

    root = ROOT
    spec = load_spec(root / "configs" / f"{config}.yaml")
    assert scan_items(str(root / "data" / "samples" / sample), None, spec.id_field, spec.check_record) == count


def test_every_shipped_config_is_covered():

    root = ROOT
    assert {p.stem for p in (root / "configs").glob("*.yaml")} == {c for c, _, _ in SHIPPED}


@pytest.mark.parametrize("text, message", [
    ("labels: [a, b]\ntemplate: {body}\n", "'template' must be a string; YAML reads an unquoted {body} as a mapping: "
                                          "quote it: template: \"{body}\""),
    ("labels: [a, b]\nexamples:\n  - text: x\n    label: c\n", "example 1 has label 'c', which is not one of the labels "
                                                              "('a', 'b')"),
])
def test_spec_messages_say_the_fix(tmp_path, text, message):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as refused:
        load_spec(path)
    assert str(refused.value) == f"{path}: {message}"


@pytest.mark.parametrize("name", ["items.jsonl", "items.csv", "export.v2.tsv", "items.jsonl.gz"])
def test_an_items_file_given_as_the_spec_says_the_order(tmp_path, name):
    path = tmp_path / name
    path.write_text('{"id": 1, "text": "a"}\n')
    with pytest.raises(SpecError) as refused:
        load_spec(path)
    assert str(refused.value) == f"{path}: is an items file, not a spec; the spec comes first: prefixcache run SPEC ITEMS"
