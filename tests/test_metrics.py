"""Evaluation metrics and reports."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from prefixcache.metrics import ABSTAIN, Evaluation


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
    md = ev.to_markdown(min_accuracy=0.9)
    assert "accuracy **0.571** (4/7)" in md and "**FAILED**" in md and "| c | 1.000 | 0.500 |" in md
    suite = ET.fromstring(ev.to_junit(min_accuracy=0.9))
    assert suite.get("failures") == "1" and suite.find("testcase/failure") is not None
    passed = ET.fromstring(ev.to_junit(min_accuracy=0.5))
    assert passed.get("failures") == "0" and len(passed.findall("testcase")) == 4


def test_multiple_choice_has_accuracy_only():
    ev = Evaluation(None)
    ev.add("four", "four")
    ev.add("two", "six")
    assert ev.accuracy == 0.5 and ev.macro_f1 is None and "per_label" not in ev.to_json()
