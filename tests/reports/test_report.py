"""`prefixcache report`: one self-contained HTML page, checked as text and, where Debian's Chromium
is installed, rendered headless: no console errors and a screenshot that is not blank."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import A, B, invoke, write_records as _write


def test_compare_reads_before_to_this_run_as_diff_does(tmp_path):
    """`report NEW --compare OLD` says what `diff OLD NEW` says: OLD's accuracy first, the fixed
    and broken items by id."""
    out, before = _write(tmp_path / "after.jsonl", B), _write(tmp_path / "before.jsonl", A)
    page = tmp_path / "report.html"
    assert invoke("report", out, "-o", page, "--compare", before).exit_code == 0
    text = page.read_text()
    assert "before → this run" in text
    assert "accuracy 0.250 → 0.750 · fixed 5 · broken 1" in text  # A: 2 of 8 right; B: 6 of 8
    assert "<b>fixed</b> (5): i2, i3, i4, i5, i6" in text and "<b>broken</b> (1): i0" in text
    diffed = invoke("diff", before, out)
    assert "accuracy 0.250 → 0.750" in diffed.stdout and "fixed 5 · broken 1" in diffed.stdout


def test_report_is_self_contained_with_every_section(tmp_path):
    out, before = _write(tmp_path / "after.jsonl", B), _write(tmp_path / "before.jsonl", A)
    page = tmp_path / "report.html"
    result = invoke("report", out, "-o", page, "--compare", before)
    assert result.exit_code == 0, result.output
    assert result.stderr == f"wrote {page}\n"
    text = page.read_text()
    # Nothing to run or fetch: no scripts, stylesheets, imports or links to resources elsewhere (the
    # SVGs' xmlns URIs are names, not fetches).
    assert "<script" not in text and "<link" not in text and "@import" not in text and "url(http" not in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)
    assert text.count("<svg") == 4  # confusion, per label, reliability, top probability and margin
    for heading in ("accuracy<b>0.750</b>", "ECE<b>", "macro-F1<b>", "wrong with the highest confidence",
                    "closest calls (smallest margin)", "compared with before.jsonl", "McNemar exact p = 0.219"):
        assert heading in text, heading
    assert "<td>t0</td>" in text  # kept input fields beside the items


def test_without_gold_only_what_needs_none(tmp_path):
    records = [{k: v for k, v in r.items() if k not in ("gold", "correct")} for r in B]
    page = tmp_path / "r.html"
    assert invoke("report", _write(tmp_path / "o.jsonl", records), "-o", page).exit_code == 0
    text = page.read_text()
    assert text.count("<svg") == 1 and "closest calls" in text and "accuracy" not in text


def test_an_existing_page_is_kept_unless_overwrite(tmp_path):
    out, page = _write(tmp_path / "o.jsonl", B), tmp_path / "r.html"
    page.write_text("someone's page")
    refused = invoke("report", out, "-o", page)
    assert refused.exit_code == 2 and page.read_text() == "someone's page"
    assert refused.stderr == f"error: {page}: already exists; give --overwrite to replace it, or another -o\n"
    assert invoke("report", out, "-o", page, "--overwrite").exit_code == 0 and "<svg" in page.read_text()


def test_failed_items_are_listed_and_the_subtitle_names_the_model(tmp_path):
    out = _write(tmp_path / "o.jsonl", B + [{"id": "bad1", "item_sha": "0" * 16, "error": "too long for the context"}])
    (tmp_path / "o.jsonl.prefixcache.json").write_text(json.dumps(
        {"model": "gguf:SmolLM2-135M-Instruct.Q4_1.gguf:d875a21f227247b7", "device": "cpu", "dtype": "float32"}))
    page = tmp_path / "r.html"
    assert invoke("report", out, "-o", page).exit_code == 0
    text = page.read_text()
    assert "items that could not be scored (1)" in text and "<td>bad1</td><td>too long for the context</td>" in text
    assert "model SmolLM2-135M-Instruct.Q4_1.gguf ·" in text and "d875a21f227247b7" not in text


def test_ece_is_in_the_metrics(tmp_path, tiny_model_dir):
    from helpers import write_spec

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"], gold="answer")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "text": f"t {k}", "answer": "tech"}) + "\n" for k in range(6)))
    metrics = tmp_path / "m.json"
    assert invoke("run", spec, src, "-o", tmp_path / "o.jsonl", "--metrics", metrics, "-q").exit_code == 0
    data = json.loads(metrics.read_text())
    records = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    # one bin per decile: with these probabilities the bins' |accuracy - confidence| by hand
    bins: dict[int, list] = {}
    for r in records:
        bins.setdefault(min(int(r["prob"] * 10), 9), []).append(r)
    want = sum(abs(sum(x["correct"] for x in b) - sum(x["prob"] for x in b)) for b in bins.values()) / len(records)
    assert data["ece"] == pytest.approx(want, abs=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(tmp_path):
    from matplotlib.image import imread

    page = tmp_path / "report.html"
    assert invoke("report", _write(tmp_path / "after.jsonl", B), "-o", page,
                  "--compare", _write(tmp_path / "before.jsonl", A)).exit_code == 0
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", "--window-size=1200,1600",
         f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ":CONSOLE(" not in run.stderr and "Uncaught" not in run.stderr  # no console errors
    pixels = imread(str(shot))
    assert pixels.shape[0] >= 1000 and float(pixels.std()) > 0.05  # not blank
    assert Path(shot).stat().st_size > 20_000
