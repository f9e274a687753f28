"""The head's cut-point: exact binomial bounds as scipy computes them, a target met on fresh data at the
stated confidence across seeds, a refusal when no cut can reach it, and `fit --target-accuracy`
writing the cut into the fitted spec for `run` to abstain below."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from helpers import invoke, json_lines, write_spec

from prefixcache.tune.cutpoint import bounds, choose_cut, least_items, risk_coverage


def calibrated(rng, n):
    """Items whose head probability is the chance its answer is right."""
    conf = 0.5 + 0.5 * rng.beta(5, 1.5, n)
    return conf, rng.random(n) < conf


def test_the_bounds_are_scipys_exact_interval_at_the_one_sided_level():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(8, 10), (45, 46), (30, 30), (0, 5), (120, 200)]:
        want = stats.binomtest(k, n).proportion_ci(confidence_level=0.90, method="exact")  # 95% one-sided each
        low, high = bounds(k, n, 0.95)
        assert abs(low - want.low) < 1e-9 and abs(high - want.high) < 1e-9


@pytest.mark.parametrize("target", [0.9, 0.95])
def test_the_cut_meets_its_target_on_fresh_data_across_seeds(target):
    misses, chosen = 0, 0
    for seed in range(120):
        rng = np.random.default_rng(seed)
        cut = choose_cut(*calibrated(rng, 600), target=target)
        if cut.chosen is None:
            continue
        chosen += 1
        conf, right = calibrated(rng, 20000)
        misses += right[conf >= cut.chosen.cut].mean() < target
    assert chosen >= 40  # 600 items find a cut in most seeds (measured: 111 and 60 of 150)
    assert misses / chosen <= 0.05  # the stated confidence (measured: 0-4%)


def test_no_cut_when_the_head_cannot_reach_the_target():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.4, 1.0, 300)
    right = rng.random(300) < 0.7  # 0.7 right at every confidence
    cut = choose_cut(conf, right, target=0.9)
    assert cut.chosen is None and cut.missed is not None and cut.missed.low < 0.9
    few = choose_cut(conf[:10], np.ones(10, bool), target=0.95)  # 10 items, all right: too few to tell
    assert few.chosen is None and few.missed is None and least_items(0.95) > 10


def test_a_coverage_answers_that_share_and_the_table_runs_most_confident_first():
    rng = np.random.default_rng(1)
    conf, right = calibrated(rng, 200)
    cut = choose_cut(conf, right, coverage=0.8)
    assert cut.chosen.coverage >= 0.8 and cut.chosen.answered == int((conf >= cut.chosen.cut).sum())
    table = risk_coverage(conf, right)
    assert [r.answered for r in table] == sorted(r.answered for r in table) and table[-1].coverage == 1.0
    with pytest.raises(ValueError):
        choose_cut(conf, right, target=0.9, coverage=0.8)


def _toy(tmp_path, n=40):
    words = {"billing": "invoice", "technical": "crash"}
    rows = [{"id": f"i{k}", "text": " ".join([words[label]] * (3 + k % 4)), "gold": label}
            for k, label in enumerate(["billing", "technical"] * (n // 2))]
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_fit_writes_the_cut_and_run_abstains_below_it(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["billing", "technical"], gold="gold")
    labelled = _toy(tmp_path)
    out = tmp_path / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", out, "--folds", "4", "--target-accuracy", "0.9")
    assert result.exit_code == 0, result.output
    assert "risk-coverage" in result.stdout and "cut: abstain below " in result.stdout
    cut = json.loads((tmp_path / "fitted.fit.json").read_text())["questions"][0]["cut"]
    assert cut["chosen"]["low"] >= 0.9 and cut["target_accuracy"] == 0.9
    assert yaml.safe_load(out.read_text())["threshold"] == pytest.approx(cut["chosen"]["cut"], abs=1e-6)
    ran = invoke("run", out, labelled, "-o", tmp_path / "preds.jsonl")
    assert ran.exit_code == 0, ran.output
    for r in json_lines(tmp_path / "preds.jsonl"):
        assert (r["label"] is None) == (r["prob"] < cut["chosen"]["cut"])  # abstained exactly below the cut
    unreachable = invoke("fit", spec, labelled, "-o", tmp_path / "f2.yaml", "--folds", "4", "--target-accuracy",
                         "0.999")
    assert unreachable.exit_code == 0 and "cut: none reaches accuracy 0.999" in unreachable.stdout
    assert "threshold" not in yaml.safe_load((tmp_path / "f2.yaml").read_text())
    both = invoke("fit", spec, labelled, "-o", tmp_path / "f3.yaml", "--target-accuracy", "0.9", "--coverage", "0.5")
    assert both.exit_code == 2 and "not both" in both.stderr
