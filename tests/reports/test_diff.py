"""`prefixcache diff`: two runs joined by id, on hand-built outputs with known flips."""

from __future__ import annotations

import json

import pytest

from helpers import A, B, hand_record as _rec, invoke, write_records as _write
from prefixcache.reports.diff import compare, mcnemar_exact


def test_the_comparison_of_a_known_pair():
    cmp = compare(A, B)
    assert cmp.both == 8 and not cmp.only_a and not cmp.only_b and cmp.same_labels
    assert dict(cmp.flips) == {("a", "b"): 1, ("b", "a"): 5}
    assert [c.id for c in cmp.changed] == ["i0", "i2", "i3", "i4", "i5", "i6"]
    assert cmp.changed[0].kept == {"title": "t0"}
    assert (cmp.accuracy_a, cmp.accuracy_b) == (2 / 8, 6 / 8)
    assert cmp.fixed == ["i2", "i3", "i4", "i5", "i6"] and cmp.broken == ["i0"]
    assert cmp.p_value == pytest.approx(0.21875)  # 2 * (C(6,0) + C(6,1)) / 2**6
    assert cmp.shifts[0].id in ("i2", "i3", "i4", "i5", "i6") and cmp.shifts[0].shift == pytest.approx(-0.5)  # p(b): 0.7 -> 0.2


def test_mcnemar_by_hand():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(2, 9) == pytest.approx(2 * (1 + 11 + 55) / 2048)


def test_cli_tables_markdown_json_and_gates(tmp_path):
    a, b = _write(tmp_path / "a.jsonl", A), _write(tmp_path / "b.jsonl", B)
    md, figures = tmp_path / "summary.md", tmp_path / "diff.json"
    md.write_text("## earlier step\n")
    result = invoke("diff", a, b, "--md", md, "--json", figures)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "8 items in both · 6 changed (75.0%)"
    assert result.stdout.splitlines()[1] == "accuracy 0.250 → 0.750 (+0.500) · fixed 5 · broken 1 · McNemar exact p = 0.219"
    assert md.read_text().startswith("## earlier step\n### prefixcache diff:")
    assert "| b | a | 5 |" in md.read_text()
    data = json.loads(figures.read_text())
    assert data["mcnemar_p"] == pytest.approx(0.21875) and data["fixed"] == ["i2", "i3", "i4", "i5", "i6"]
    gated = invoke("diff", a, b, "--fail-on-change", 0.5)
    assert gated.exit_code == 5
    assert gated.stderr == "gate failed: 75.0% of the items changed label, more than --fail-on-change 0.5\n"
    assert invoke("diff", a, b, "--fail-on-regression").exit_code == 0
    worse = invoke("diff", b, a, "--fail-on-regression")
    assert worse.exit_code == 5 and worse.stderr == "gate failed: accuracy dropped from 0.7500 to 0.2500\n"


def test_refusals_and_different_label_sets(tmp_path):
    a = _write(tmp_path / "a.jsonl", A)
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"name": "not an output"}\n{"name": "still not"}\n')
    result = invoke("diff", a, foreign)
    assert result.exit_code == 2
    assert result.stderr == f"error: {foreign}: line 1 is not a record; is this a prefixcache output?\n"
    assert invoke("diff", a, tmp_path / "missing.jsonl").stderr == f"error: {tmp_path / 'missing.jsonl'}: no such file\n"
    nogold = _write(tmp_path / "nogold.jsonl", [_rec("i0", "a", {"a": 0.5, "c": 0.5})])
    refused = invoke("diff", a, nogold, "--fail-on-regression")
    assert refused.exit_code == 2
    assert refused.stderr == "error: --fail-on-regression needs gold values in both outputs (run with --gold)\n"
    other = invoke("diff", a, nogold)
    assert other.exit_code == 0 and "different label sets" in other.stdout
    assert other.stdout.splitlines()[0].startswith("1 items in both · 0 changed")


def test_top_cuts_every_listing_and_says_so(tmp_path):
    a, b = _write(tmp_path / "a.jsonl", A), _write(tmp_path / "b.jsonl", B)
    md, js = tmp_path / "d.md", tmp_path / "d.json"
    result = invoke("diff", a, b, "--md", md, "--json", js, "--top", 2)
    assert result.exit_code == 0, result.output
    data = json.loads(js.read_text())
    assert [c["id"] for c in data["changed_items"]] == ["i0", "i2"] and data["changed_items_listed"] == "2 of 6"
    assert len(data["largest_shifts"]) == 2
    text = md.read_text()
    assert "| i2 |" in text and "| i3 |" not in text and "4 more changed items (--top 2 listed)" in text
    assert "the first 2 of 6: --top N lists more" in result.stdout  # the terminal's tables say so too


def test_quiet_prints_only_the_gates_verdict(tmp_path):
    a, b = _write(tmp_path / "a.jsonl", A), _write(tmp_path / "b.jsonl", B)
    quiet = invoke("diff", a, b, "-q", "--fail-on-change", 0.5)
    assert quiet.exit_code == 5 and quiet.stdout == ""
    assert quiet.stderr == "gate failed: 75.0% of the items changed label, more than --fail-on-change 0.5\n"


def test_help_reads_as_a_shell_user_expects():
    usage = invoke("run", "--help", env={"COLUMNS": "100"}).stdout
    assert "Usage: prefixcache run [OPTIONS] SPEC ITEMS" in usage and "{SPEC}" not in usage
    assert "<bool>" not in usage
