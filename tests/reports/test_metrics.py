"""Evaluation metrics and reports."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from prefixcache.reports.evaluation import ABSTAIN, Evaluation, Gates


def _filled() -> Evaluation:
    ev = Evaluation(["a", "b", "c"])
    pairs = [("a", "a"), ("a", "a"), ("a", "b"), ("b", "b"), ("b", "a"), ("c", "c"), ("c", None)]
    for gold, pred in pairs:
        ev.add(gold, pred)
    return ev


def test_accuracy_per_label_and_macro_f1():
    ev = _filled()
    assert (ev.n, ev.correct, ev.abstained) == (7, 4, 1)
    assert ev.accuracy == pytest.approx(4 / 7) and ev.coverage == pytest.approx(6 / 7)
    stats = ev.per_label()
    assert stats["a"] == {"precision": pytest.approx(2 / 3), "recall": pytest.approx(2 / 3), "f1": pytest.approx(2 / 3), "support": 3}
    assert stats["b"]["precision"] == 0.5 and stats["b"]["recall"] == 0.5
    assert stats["c"]["precision"] == 1.0 and stats["c"]["recall"] == 0.5 and stats["c"]["f1"] == pytest.approx(2 / 3)
    assert ev.macro_f1 == pytest.approx((2 / 3 + 0.5 + 2 / 3) / 3)
    columns, rows = ev.matrix()
    assert columns == ["a", "b", "c", ABSTAIN]
    assert rows == [[2, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]]


def test_reports():
    ev = _filled()
    data = json.loads(json.dumps(ev.to_json()))
    assert data["accuracy"] == pytest.approx(4 / 7) and data["confusion"]["matrix"][2] == [0, 0, 1, 1]
    md = ev.to_markdown(Gates(min_accuracy=0.9))
    assert "accuracy **0.571** (4/7)" in md and "**FAILED**" in md and "| c | 1.000 | 0.500 |" in md
    suite = ET.fromstring(ev.to_junit(Gates(min_accuracy=0.9), seconds=1.5))
    assert suite.get("failures") == "1" and suite.get("time") == "1.500"
    [failed] = [case for case in suite.findall("testcase") if case.find("failure") is not None]
    assert failed.get("name") == "accuracy"
    assert failed.find("failure").get("message") == "accuracy 0.5714 is below --min-accuracy 0.9"
    passed = ET.fromstring(ev.to_junit(Gates(min_accuracy=0.5)))
    # Stable names: the values are in each case's output, never in its name.
    assert [c.get("name") for c in passed.findall("testcase")] == ["accuracy", "recall[a]", "recall[b]", "recall[c]"]
    assert passed.get("failures") == "0" and passed.find("testcase/system-out").text == "accuracy 0.5714"
    recall = ET.fromstring(ev.to_junit(Gates(min_recall=0.6)))
    assert [c.get("name") for c in recall.findall("testcase") if c.find("failure") is not None] == ["recall[b]", "recall[c]"]
    assert ev.gate_failures(Gates(min_recall=0.6)) == ["recall of 'b' 0.5000 is below --min-recall 0.6",
                                                       "recall of 'c' 0.5000 is below --min-recall 0.6"]
    assert ev.gate_failures(Gates()) == []


def test_multiple_choice_has_accuracy_only():
    ev = Evaluation(None)
    ev.add("four", "four")
    ev.add("two", "six")
    assert ev.accuracy == 0.5 and ev.macro_f1 is None and "per_label" not in ev.to_json()
