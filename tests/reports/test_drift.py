"""`prefixcache drift`: a run against a reference run on other items, without labels."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from helpers import hand_record, invoke, write_records
from prefixcache.data.output import fingerprint_path
from prefixcache.reports.drift import (chi2_sf, compare_runs, estimate_accuracy, fingerprint_changes, fisher_exact,
                                       kolmogorov_sf, runs_tests)

LABELS = ("billing", "technical", "account")
FINGERPRINT = {"spec": "s1", "model": "m1", "engine": "transformers", "engine_version": "5", "dtype": "float32",
               "exact": False, "device": "cpu", "input": "i1"}


def _run(rng, n, shares=(0.5, 0.3, 0.2), sharpness=4.0, failed=0.0, abstain=0.0):
    """`n` label records as run writes them: each item's probabilities a Dirichlet draw leaning on
    a label drawn with `shares` (`sharpness`: how far), its label the most probable; some
    abstained or failed."""
    out = []
    for k in range(n):
        if rng.random() < failed:
            out.append({"id": f"r{k}", "error": "too long"})
            continue
        alpha = np.ones(len(LABELS))
        alpha[int(rng.choice(len(LABELS), p=shares))] += sharpness
        p = rng.dirichlet(alpha)
        record = hand_record(f"r{k}", None if rng.random() < abstain else LABELS[int(p.argmax())],
                             dict(zip(LABELS, p.tolist(), strict=True)))
        top = np.sort(p)
        record["margin"] = float(top[-1] - top[-2])
        out.append(record)
    return out


def _files(tmp_path, before, after, fingerprint_after=None):
    a, b = write_records(tmp_path / "ref.jsonl", before), write_records(tmp_path / "cur.jsonl", after)
    fingerprint_path(str(a)).write_text(json.dumps(FINGERPRINT))
    fingerprint_path(str(b)).write_text(json.dumps(fingerprint_after or FINGERPRINT))
    return a, b


def test_the_distributions_are_those_scipy_gives():
    stats = pytest.importorskip("scipy.stats")
    for x, df in ((0.5, 1), (3.84, 1), (10.0, 3), (200.0, 149), (30.0, 2)):
        assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9)
    for t in (0.3, 0.8, 1.36, 2.0):
        assert kolmogorov_sf(t) == pytest.approx(stats.kstwobign.sf(t), rel=1e-9)
    for k1, n1, k2, n2 in ((3, 50, 9, 60), (0, 100, 5, 100), (10, 20, 2, 20)):
        assert fisher_exact(k1, n1, k2, n2) == pytest.approx(stats.fisher_exact([[k1, n1 - k1], [k2, n2 - k2]])[1])


def test_samples_of_one_process_rarely_alarm_and_a_shifted_one_always_does():
    """Forty pairs of runs of one process alarm at about the rate asked (alpha 0.05: at most 5 of
    40); every pair whose label shares moved (or whose confidence fell, or whose failures rose)
    alarms."""
    rng = np.random.default_rng(0)
    same = [_alarm(_run(rng, 300), _run(rng, 250), 0.05) for _ in range(40)]
    assert sum(same) <= 5
    assert all(_alarm(_run(rng, 300), _run(rng, 250, shares=(0.3, 0.3, 0.4)), 0.01) for _ in range(5))
    assert all(_alarm(_run(rng, 300), _run(rng, 250, sharpness=0.5), 0.01) for _ in range(5))
    assert all(_alarm(_run(rng, 300), _run(rng, 250, failed=0.08), 0.01) for _ in range(5))


def _alarm(before, after, alpha):
    tests = runs_tests(before, after)
    return any(t.p < alpha / len(tests) for t in tests)


def test_a_run_against_itself_is_no_drift_and_every_test_is_there(tmp_path):
    before = _run(np.random.default_rng(1), 120, abstain=0.1, failed=0.05)
    a, b = _files(tmp_path, before, before)
    drift = compare_runs(str(a), str(b))
    assert [t.name for t in drift.tests] == ["labels shares", "labels confidence", "labels margin", "failed items"]
    assert all(t.p == pytest.approx(1.0) for t in drift.tests) and not drift.alarm and drift.changed == []
    assert drift.line().startswith("drift: no drift (least p=1") and "120 items against 120" in drift.line()


def test_the_cli_says_a_line_gates_on_request_and_names_what_the_fingerprint_changed(tmp_path):
    rng = np.random.default_rng(2)
    moved = {**FINGERPRINT, "model": "m2", "input": "i2"}
    a, b = _files(tmp_path, _run(rng, 300), _run(rng, 300, shares=(0.2, 0.3, 0.5)), moved)
    md, figures = tmp_path / "drift.md", tmp_path / "drift.json"
    result = invoke("drift", a, b, "--md", md, "--json", figures)
    assert result.exit_code == 0, result.output
    line = result.stderr.strip()
    assert line.startswith("drift: DRIFT: labels shares (p=") and "billing 48% -> 21%" in line
    assert "300 items against 300; estimated accuracy 0." in line  # the input is not a change:
    assert line.endswith("; changed: the model (m1 -> m2)"), line
    assert "labels shares" in result.stdout and "changed: the model (m1 -> m2)" in result.stdout
    data = json.loads(figures.read_text())
    assert data["alarm"] is True and data["changed"] == ["the model (m1 -> m2)"] and data["items"] == [300, 300]
    assert md.read_text().startswith("### prefixcache drift: DRIFT")
    assert invoke("drift", a, b, "--fail-on-drift", "-q").exit_code == 5
    steady = invoke("drift", a, a, "--fail-on-drift", "-q")
    assert steady.exit_code == 0 and steady.stdout == "" and steady.stderr.startswith("drift: no drift")


def test_tags_and_questions_are_tested_per_label_and_per_question():
    tags = [{"id": str(k), "labels": ["a"] if k % 3 else [], "probs": {"a": 0.8 if k % 3 else 0.2, "b": 0.1}}
            for k in range(60)]
    assert [t.name for t in runs_tests(tags, tags)] == ["label a shares", "label a confidence", "label b confidence",
                                                        "failed items"]
    answers = [{"id": str(k), "answers": {"q": {"type": "choice", "choice": "x" if k % 2 else "y", "confidence": 0.5,
                                                "probabilities": {"x": 0.7, "y": 0.3}}}} for k in range(40)]
    names = [t.name for t in runs_tests(answers, answers)]
    assert names == ["question q shares", "question q confidence", "failed items"]


def test_fingerprints_missing_or_changed_are_said_as_facts():
    assert fingerprint_changes({}, FINGERPRINT) == ["the reference has no fingerprint: what produced it is unknown"]
    changed = fingerprint_changes(FINGERPRINT, {**FINGERPRINT, "dtype": "bfloat16", "spec": "s2", "head": "h"})
    assert changed == ["the spec (s1 -> s2)", "the fitted head (none -> h)", "the precision (float32 -> bfloat16)"]


def test_refusals(tmp_path):
    a = write_records(tmp_path / "a.jsonl", [hand_record("x", "a", {"a": 1.0})])
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert invoke("drift", a, empty).exit_code == 2
    assert "holds no records" in invoke("drift", a, empty).stderr
    assert invoke("drift", a, a, "--alpha", "0").exit_code == 2
    assert invoke("drift", a, a, "--md", a).exit_code == 2
    alone = compare_runs(str(a), str(a))  # one label: no shares to test; confidence, margin and failures
    assert alone.changed == ["neither run has a fingerprint: what produced them is unknown"]
    assert math.isclose(alone.cut, 0.01 / 3) and alone.alpha == 0.01


def test_the_accuracy_estimate_is_the_answers_mean_probability_and_holds_where_they_are_calibrated(tmp_path):
    """Calibrated answers (right with their probability): the estimate lies within three standard
    errors of the realised accuracy in each of 20 runs; a gate on it fails below its bound."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        records = _run(rng, 200, abstain=0.1)
        for r in records:
            if r.get("label") is not None:
                r.update(gold="x", correct=bool(rng.random() < r["prob"]))
        estimate = estimate_accuracy(records)
        assert estimate is not None and estimate.answered == sum(r.get("label") is not None for r in records)
        assert abs(estimate.value - estimate.realised) < 3 * estimate.error
    a, b = _files(tmp_path, records, records)
    found = compare_runs(str(a), str(b))
    assert found.estimates[1] == estimate and f"estimated accuracy {estimate.value:.3f}" in found.line()
    gated = invoke("drift", a, b, "-q", "--min-estimated-accuracy", 0.99)
    assert gated.exit_code == 5, gated.output
    assert f"gate failed: the estimated accuracy {estimate.value:.4f} is below --min-estimated-accuracy 0.99" in gated.stderr
    assert invoke("drift", a, b, "-q", "--min-estimated-accuracy", 0.1).exit_code == 0
    tags = [{"id": "1", "labels": ["a"], "probs": {"a": 0.9}}]
    assert estimate_accuracy(tags) is None
    for r in records:  # a head's held-out reliability, where its records carry it, is what is averaged
        r["p_correct"] = 0.25
    held = estimate_accuracy(records)
    assert held is not None and held.held_out and held.value == pytest.approx(0.25) and held.words().startswith(
        "0.250 ± ") and "held-out reliability" in held.words()
    write_records(b, records)  # the estimates from two sources: the line says which is which
    assert (f"estimated accuracy 0.250 from held-out reliability (reference {estimate.value:.3f} from the answers' "
            f"probabilities)") in compare_runs(str(a), str(b)).line()


def test_items_unlike_a_heads_fitted_rows_are_tested_where_records_say_how_far_they_lie():
    rng = np.random.default_rng(4)
    before, after = _run(rng, 200), _run(rng, 200)
    for side, outside in ((before, 0.01), (after, 0.2)):
        for r in side:
            r["novelty"] = 1.5 if rng.random() < outside else 0.5
    tests = {t.name: t for t in runs_tests(before, after)}
    assert tests["items unlike the head's fitted rows"].p < 1e-4 and "-> 2" in tests["items unlike the head's fitted rows"].words
    assert "items unlike the head's fitted rows" not in {t.name for t in runs_tests(_run(rng, 50), _run(rng, 50))}


def test_the_report_shows_the_runs_over_time_each_against_the_first(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(6)
    runs = [write_records(tmp_path / f"night{k}.jsonl", _run(rng, 150, shares=shares))
            for k, shares in enumerate([(0.5, 0.3, 0.2), (0.5, 0.3, 0.2), (0.1, 0.3, 0.6)])]
    page = tmp_path / "runs.html"
    result = invoke("report", runs[1], "-o", page, "--earlier", runs[0], "--earlier", runs[2])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    section = text[text.index("the runs over time"):text.index("</table>", text.index("the runs over time"))]
    assert [row.split("</td>")[0] for row in section.split("<tr><td>")[1:]] == ["night0.jsonl", "night2.jsonl",
                                                                               "night1.jsonl"]
    assert section.count("DRIFT") == 1 and "no drift" in section and "<td>reference</td>" in section
    assert invoke("report", runs[1], "-o", runs[0], "--earlier", runs[0], "--overwrite").exit_code == 2
