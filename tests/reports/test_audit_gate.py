"""An audit in production: labelled items drawn at random from what a fitted spec answers, run
with --min-answered-accuracy, fail a CI step (exit 5) when the answered items' accuracy has an
exact 95% lower bound below the target; the bound is the Clopper-Pearson one."""

from __future__ import annotations

import json

import pytest
from helpers import invoke, write_spec

from prefixcache.reports.evaluation import exact_lower_bound


@pytest.mark.parametrize("correct, n", [(0, 10), (1, 1), (9, 10), (50, 50), (95, 100), (880, 1000), (3, 40)])
def test_the_lower_bound_is_clopper_pearsons(correct, n):
    beta = pytest.importorskip("scipy.stats").beta
    want = 0.0 if correct == 0 else float(beta.ppf(0.05, correct, n - correct + 1))
    assert exact_lower_bound(correct, n) == pytest.approx(want, abs=1e-6)


def test_the_answered_accuracy_gate_counts_answered_items_only(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["billing", "technical"], gold="gold")
    items = tmp_path / "audit.jsonl"
    items.write_text("".join(json.dumps({"id": k, "text": f"ticket {k}", "gold": "billing"}) + "\n" for k in range(12)))
    first = invoke("run", spec, items, "-o", tmp_path / "a.jsonl", "--metrics", tmp_path / "m.json",
                   "--min-answered-accuracy", "0.0")
    assert first.exit_code == 0, first.output
    right = sum(json.loads(line)["correct"] for line in (tmp_path / "a.jsonl").read_text().splitlines())
    result = invoke("run", spec, items, "-o", tmp_path / "b.jsonl", "--min-answered-accuracy", "0.99")
    assert result.exit_code == 5
    assert f"the answered items' accuracy {right}/12 has a 95% lower bound of" in result.stderr
    typed = write_spec(tmp_path, name="typed.yaml", model=str(tiny_model_dir),
                       questions={"q": {"type": "noul", "instructions": "Urgent?", "gold": "gold"}})
    refused = invoke("run", typed, items, "-o", tmp_path / "c.jsonl", "--min-answered-accuracy", "0.9")
    assert refused.exit_code == 2 and "applies to a label set or multiple choice" in refused.stderr
