"""Unattended runs over inputs that change between runs, and the messages that get a person back on
track: growing files, re-exports, resume hints, refused resumes, counts, reports."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from helpers import invoke, write_spec

from prefixcache.errors import Interrupted
from prefixcache.run.job import run_job
from prefixcache.run.options import RunOptions, command_line

WORDS = "crash refund password invoice login error slow payment account screen update billing".split()


def _rows(ids) -> list[dict]:
    return [{"id": f"t{n}", "text": f"{WORDS[n % 12]} {WORDS[(n * 5) % 12]} ticket {n}", "cat": "tech"} for n in ids]


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]



@pytest.fixture()
def spec_path(tmp_path, tiny_model_dir):
    return write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "technical", "billing"], gold=None)


def _same_scores(got: dict, want: dict) -> None:
    assert got["id"] == want["id"] and got["label"] == want["label"] and got["item_sha"] == want["item_sha"]
    assert max(abs(got["logprobs"][k] - want["logprobs"][k]) for k in want["logprobs"]) < 1e-4


def test_cron_recipe_on_a_growing_file_then_a_reordered_re_export(spec_path, tmp_path):
    """The documented cron command, run as the input grows and then as a re-export comes in a new
    order with one item changed: each run scores only what is new or changed, and the output ends
    equal to a fresh full run on the final input."""
    src, out = tmp_path / "today.jsonl", tmp_path / "out.jsonl"
    cron = ["run", spec_path, src, "-o", out, "--update", "--on-error", "skip", "-b", 4]
    scored = []
    for ids in (range(0, 7), range(0, 10), range(0, 16)):  # the file grows between runs
        _write(src, _rows(ids))
        result = invoke(*cron)
        assert result.exit_code == 0, result.output
        scored.append(int(result.stderr.split(" items in ")[0].split()[-1]))
    assert scored == [7, 3, 6]
    assert [r["id"] for r in _records(out)] == [f"t{n}" for n in range(16)]

    export = list(reversed(_rows(range(0, 18))))  # a fresh export: new order, two new items ...
    export[5] = {**export[5], "text": export[5]["text"] + " (edited)"}  # ... and one changed
    _write(src, export)
    result = invoke(*cron)
    assert result.exit_code == 0, result.output
    assert "15 unchanged items kept, 0 dropped, 3 items in" in result.stderr  # t16, t17 and the edited t12
    fresh = tmp_path / "fresh.jsonl"
    assert invoke("run", spec_path, src, "-o", fresh, "-b", 4, "-q").exit_code == 0
    got, want = _records(out), _records(fresh)
    assert [r["id"] for r in got] == [r["id"] for r in export]  # every item once, in the export's order
    for g, w in zip(got, want):
        _same_scores(g, w)
    assert not list(tmp_path.glob(".out.jsonl.*"))  # no file left aside
    again = invoke(*cron)  # nothing changed: no model load, nothing rewritten
    assert again.exit_code == 0 and again.stderr.endswith(f"prefixcache: nothing to do: {out} already holds all 18 records\n")
    assert len(again.stderr.splitlines()) == 1


def test_resume_continues_an_input_that_only_grew(spec_path, tmp_path):
    src, out = _write(tmp_path / "in.jsonl", _rows(range(5))), tmp_path / "out.jsonl"
    assert invoke("run", spec_path, src, "-o", out, "-q").exit_code == 0
    first = out.read_bytes()
    _write(src, _rows(range(8)))
    result = invoke("run", spec_path, src, "-o", out, "--resume")
    assert result.exit_code == 0, result.output
    assert "5 items already done, 3 items in" in result.stderr
    assert out.read_bytes().startswith(first) and [r["id"] for r in _records(out)] == [f"t{n}" for n in range(8)]
    done = invoke("run", spec_path, src, "-o", out, "--resume")  # complete: no model load
    assert done.exit_code == 0 and done.stderr.endswith(f"prefixcache: nothing to do: {out} already holds all 8 records\n")


def test_stdin_honours_limit(spec_path, tmp_path):
    data = "".join(json.dumps(r) + "\n" for r in _rows(range(9)))
    result = invoke("run", spec_path, "-", "--format", "jsonl", "-n", 5, "-q", input=data)
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 5


def test_the_resume_hint_is_the_command_with_resume(spec_path, tmp_path):
    src, out = _write(tmp_path / "items.jsonl", _rows(range(6))), tmp_path / "out.jsonl"
    options = RunOptions(spec_path, str(src), output=str(out), batch_size=2, gold="cat", overwrite=True)
    with pytest.raises(Interrupted) as stopped:
        run_job(options, stop=lambda: signal.SIGINT)
    hint = f"prefixcache run {spec_path} {src} -o {out} --batch-size 2 --gold cat --resume"
    assert str(stopped.value) == f"interrupted by SIGINT: 2 records written to {out} by this run; resume with: {hint}"
    assert command_line(options) == hint
    resumed = invoke(*hint.split()[1:])  # pasted as printed
    assert resumed.exit_code == 0, resumed.output
    assert len(_records(out)) == 6


def test_a_batch_abandoned_after_a_stop_still_prints_the_resume_command(spec_path, tmp_path):
    """The signal handler gives up on a slow batch by raising from inside it; the command to go on
    is printed all the same."""
    src, out = _write(tmp_path / "items.jsonl", _rows(range(6))), tmp_path / "out.jsonl"
    options = RunOptions(spec_path, str(src), output=str(out), batch_size=2)
    abandoned = "interrupted by SIGINT: the batch in flight did not finish within 10 s and was abandoned"

    def slow_batch(event):
        if event.phase == "batch" and event.written == 4:
            raise Interrupted(signal.SIGINT, abandoned)

    with pytest.raises(Interrupted) as stopped:
        run_job(options, progress=slow_batch)
    assert str(stopped.value) == f"{abandoned}; resume with: prefixcache run {spec_path} {src} -o {out} --batch-size 2 --resume"
    assert stopped.value.exit_code == 130 and len(_records(out)) == 4


def test_a_refused_resume_names_the_options_to_add_back(spec_path, tmp_path):
    src, out = _write(tmp_path / "items.jsonl", _rows(range(4))), tmp_path / "out.jsonl"
    assert invoke("run", spec_path, src, "-o", out, "--gold", "cat", "-b", 16, "-q", "--limit", 2).exit_code == 0
    refused = invoke("run", spec_path, src, "-o", out, "--resume")
    assert refused.exit_code == 2
    assert refused.stderr == (f"error: {out}: cannot continue it: it was written with --gold cat and "
                              "--batch-size 16; add them back to continue it, or choose another output file\n")
    assert "--overwrite" not in refused.stderr


def test_gold_added_to_a_written_output_says_exactly_what_to_do(spec_path, tmp_path):
    src, out = _write(tmp_path / "items.jsonl", _rows(range(4))), tmp_path / "out.jsonl"
    assert invoke("run", spec_path, src, "-o", out, "-q").exit_code == 0
    refused = invoke("run", spec_path, src, "-o", out, "--gold", "cat", "--resume")
    assert refused.exit_code == 2
    other = tmp_path / "out.cat.jsonl"
    assert refused.stderr == (f"error: {out}: was written without a gold field, so its records hold no 'cat' values to "
                              f"evaluate; write the evaluated run to another output (-o {other} --gold cat); or drop "
                              f"--gold cat to continue this one\n")
    followed = invoke("run", spec_path, src, "-o", other, "--gold", "cat", "-q")  # doing as told works
    assert followed.exit_code == 0 and all("correct" in r for r in _records(other))


def test_resume_and_overwrite_together_is_a_usage_error(spec_path, tmp_path):
    src = _write(tmp_path / "in.jsonl", _rows(range(2)))
    result = invoke("run", spec_path, src, "-o", tmp_path / "o.jsonl", "--resume", "--overwrite")
    assert result.exit_code == 2
    assert result.stderr == "error: --overwrite starts the output again; --resume continues it: give one of them\n"


@pytest.mark.parametrize("link", ["same", "symlink", "hardlink"])
def test_the_output_may_not_be_the_input(spec_path, tmp_path, link):
    src = _write(tmp_path / "data.jsonl", _rows(range(3)))
    target = src
    if link != "same":
        target = tmp_path / "alias.jsonl"
        (os.symlink if link == "symlink" else os.link)(src, target)
    before = src.read_bytes()
    result = invoke("run", spec_path, src, "-o", target, "--overwrite")
    assert result.exit_code == 2
    assert result.stderr == f"error: {target}: is the input file {src}; write the output to another file\n"
    assert src.read_bytes() == before


def test_a_misspelt_id_field_is_refused_before_the_model_loads(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"], id_field="reviewid")
    src = _write(tmp_path / "in.jsonl", [{"review_id": 1, "text": "x"}, {"review_id": 2, "text": "y"}])
    result = invoke("run", spec, src)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {src}: no item has the id field 'reviewid' set by the spec's 'id_field'; "
                             "the items' fields are 'review_id', 'text'\n")


def test_failed_items_count_as_items_and_as_wrong(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"], gold="answer")
    rows = [{"id": n, "text": f"ticket {n}", "answer": "tech"} for n in range(4)]
    del rows[2]["text"]
    src, metrics = _write(tmp_path / "in.jsonl", rows), tmp_path / "m.json"
    result = invoke("run", spec, src, "-o", tmp_path / "o.jsonl", "--on-error", "skip", "--metrics", metrics)
    assert result.exit_code == 4
    assert "duplicates reused" not in result.stderr
    data = json.loads(metrics.read_text())
    assert (data["items"], data["failed"]) == (4, 1) and data["coverage"] == 0.75
    assert data["correct"] <= 3 and data["accuracy"] == data["correct"] / 4


def test_summary_md_appends_to_an_existing_summary(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"], gold="answer")
    src = _write(tmp_path / "in.jsonl", [{"id": n, "text": f"t {n}", "answer": "tech"} for n in range(3)])
    summary = tmp_path / "step_summary.md"
    summary.write_text("## Earlier step\n")
    for out in ("a.jsonl", "b.jsonl"):
        assert invoke("run", spec, src, "-o", tmp_path / out, "--summary-md", summary, "-q").exit_code == 0
    text = summary.read_text()
    assert text.startswith("## Earlier step\n") and text.count("### prefixcache evaluation") == 2


def test_summary_md_names_the_run_and_each_gate_missed(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"], gold="answer")
    # The same text twice with each gold label: one prediction, so accuracy 0.5 and one label's recall 0.
    src = _write(tmp_path / "in.jsonl", [{"id": n, "text": "same ticket", "answer": ["tech", "billing"][n]} for n in (0, 1)])
    summary, out = tmp_path / "summary.md", tmp_path / "o.jsonl"
    gated = invoke("run", spec, src, "-o", out, "--summary-md", summary, "--min-accuracy", 0.6, "--min-recall", 0.9, "-q")
    assert gated.exit_code == 5
    text = summary.read_text()
    assert f"spec `{spec}` · model `{tiny_model_dir}` · input `{src}` · output `{out}`" in text
    assert "gates: **FAILED**" in text
    assert "- gate failed: accuracy 0.5000 is below --min-accuracy 0.6" in text
    assert re.search(r"- gate failed: recall of '(tech|billing)' 0.0000 is below --min-recall 0.9", text)


def test_update_drops_items_no_longer_in_the_input_and_an_interrupted_update_changes_nothing(spec_path, tmp_path):
    src, out = _write(tmp_path / "in.jsonl", _rows(range(6))), tmp_path / "out.jsonl"
    assert invoke("run", spec_path, src, "-o", out, "-q").exit_code == 0
    before = out.read_bytes()
    _write(src, _rows([0, 1, 2, 7, 8]))
    options = RunOptions(spec_path, str(src), output=str(out), update=True)
    with pytest.raises(Interrupted) as stopped:
        run_job(options, stop=lambda: signal.SIGTERM)
    assert str(stopped.value) == (f"interrupted by SIGTERM: {out} is unchanged; update it with: "
                                  f"prefixcache run {spec_path} {src} -o {out} --update")
    assert out.read_bytes() == before and not list(tmp_path.glob(".out.jsonl.*"))
    result = run_job(options)
    assert (result.kept, result.dropped, result.stats.items) == (3, 3, 2)
    assert [r["id"] for r in _records(out)] == ["t0", "t1", "t2", "t7", "t8"]


def test_predictions_piled_on_one_label_are_warned_about(spec_path, tmp_path):
    same = _write(tmp_path / "same.jsonl", [{"id": n, "text": "the same ticket"} for n in range(24)])  # one label
    warned = invoke("run", spec_path, same, "-o", tmp_path / "o.jsonl")
    assert warned.exit_code == 0
    assert "100% of the items (24 of 24) got the label" in warned.stderr and "'calibrate: true'" in warned.stderr
    few = _write(tmp_path / "few.jsonl", [{"id": n, "text": "the same ticket"} for n in range(5)])
    assert "got the label" not in invoke("run", spec_path, few, "-o", tmp_path / "f.jsonl").stderr  # too few to tell


def test_the_pile_up_warning_looks_at_the_whole_output_not_the_resumed_part(spec_path, tmp_path):
    rows = [{"id": n, "text": "the same ticket" if n >= 10 else f"{WORDS[n]} ticket {n} {WORDS[(n * 7) % 12]}"}
            for n in range(40)]
    src, out = _write(tmp_path / "in.jsonl", rows), tmp_path / "o.jsonl"
    first = invoke("run", spec_path, src, "-o", out, "--limit", 10, "-q")
    assert first.exit_code == 0
    labels = {r["label"] for r in _records(out)}
    resumed = invoke("run", spec_path, src, "-o", out, "--resume")  # 30 identical items: one label for this part
    assert resumed.exit_code == 0
    pile = max(sum(r["label"] == lab for r in _records(out)) for lab in labels | {r["label"] for r in _records(out)})
    assert ("got the label" in resumed.stderr) == (pile / 40 >= 0.9)
    assert "of 30)" not in resumed.stderr  # the resumed part alone is never what is judged
