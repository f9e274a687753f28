"""The output and the files beside it: refused targets, full disks, one writer at a time, merges,
error records, report files and what they say."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import re
import subprocess
import sys
import pytest
from helpers import invoke, records as _no_ms, write_spec
import time
from helpers import records as _records
from helpers import LABELS3, WORDS, damage, items_file, json_lines, jsonl_of_ids, refund_items_file, ticket_rows, ticket_texts, write_jsonl, write_texts


# -- text from the data, shown as it is -------------------------------------------------------
HOSTILE_LABELS = ["[/]", "[link=https://evil.example]click[/link]", "a|b", "$5 off $20", "R&D <team>"]


def _hostile_runs(tmp_path):
    from helpers import hand_record, write_records

    even = {name: 1 / len(HOSTILE_LABELS) for name in HOSTILE_LABELS}
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ids = ["[bold]x[/bold]", "line\nbreak", "pipe|id", "[/]", "plain"]
    write_records(a, [hand_record(i, HOSTILE_LABELS[k], even, HOSTILE_LABELS[k]) for k, i in enumerate(ids)])
    write_records(b, [hand_record(i, HOSTILE_LABELS[(k + 1) % 5], even, HOSTILE_LABELS[k]) for k, i in enumerate(ids)])
    return a, b


def test_a_full_disk_names_the_output_and_keeps_what_was_written(spec_path, tmp_path, monkeypatch):
    from prefixcache.data import resume  # where the output file is opened for a run

    src, out = items_file(tmp_path, 6), tmp_path / "o.jsonl"
    real_open = resume.open_writer

    class FillingDisk:
        """The output file, on a disk that is full after two records."""

        def __init__(self, stream):
            self.stream, self.name, self.writes = stream, stream.name, 0

        def write(self, text):
            self.writes += 1
            if self.writes > 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.stream.write(text)

        def flush(self):
            self.stream.flush()

        def close(self):
            self.stream.close()

    def open_writer(*args, **kwargs):
        writer = real_open(*args, **kwargs)
        writer.stream = FillingDisk(writer.stream)
        return writer

    monkeypatch.setattr(resume, "open_writer", open_writer)
    result = invoke("run", spec_path, src, "-o", out, "-b", 1, "-q")
    assert result.exit_code == 2
    assert result.stderr == f"error: {out}: cannot write the output: No space left on device\n"
    monkeypatch.undo()
    assert len(out.read_text().splitlines()) == 2
    resumed = invoke("run", spec_path, src, "-o", out, "-b", 1, "--resume", "-q")  # space freed: continue
    assert resumed.exit_code == 0 and len(out.read_text().splitlines()) == 6


def test_merge_of_damaged_parts_is_complete_or_refused(spec_path, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"m{k}", "text": f"ticket {k}"}) + "\n" for k in range(10)))
    whole, parts = tmp_path / "whole.jsonl", [tmp_path / f"p{k}.jsonl" for k in (1, 2)]
    assert invoke("run", spec_path, src, "-o", whole, "-b", 2, "-q").exit_code == 0
    for k, part in enumerate(parts, 1):
        assert invoke("run", spec_path, src, "-o", part, "-b", 2, "-q", "--shard", f"{k}/2").exit_code == 0
    good = [p.read_bytes() for p in parts]
    rng = random.Random(11)
    for case in range(30):
        victim = rng.randrange(2)
        parts[victim].write_bytes(damage(good[victim], rng))
        merged = tmp_path / f"merged{case}.jsonl"
        result = invoke("merge", *parts, "-o", merged)
        assert result.exit_code in (0, 2), result.output
        if result.exit_code == 0:
            assert _no_ms(merged) == _no_ms(whole), case
        else:
            assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ") and not merged.exists()
        parts[victim].write_bytes(good[victim])


@pytest.mark.parametrize("extra", [(), ("--update",), ("--resume",)])
def test_a_run_on_an_output_another_process_writes_is_refused(tmp_path, tiny_model_dir, extra):
    from prefixcache.data.lock import output_lock

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 3), tmp_path / "out.jsonl"
    if extra:
        assert invoke("run", spec, items, "-o", out, "-q").exit_code == 0
    before = out.read_bytes() if out.exists() else None
    with output_lock(str(out)):
        result = invoke("run", spec, items, "-o", out, *extra)
    assert result.exit_code == 2 and "another prefixcache process is writing it (pid" in result.output, result.output
    assert (out.read_bytes() if out.exists() else None) == before


def test_merge_into_an_output_another_process_writes_is_refused(tmp_path, tiny_model_dir):
    from prefixcache.data.lock import output_lock

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 4), tmp_path / "merged.jsonl"
    parts = [tmp_path / f"p{k}.jsonl" for k in (1, 2)]
    for k, part in enumerate(parts, 1):
        assert invoke("run", spec, items, "-o", part, "--shard", f"{k}/2", "-q", "--batch-size", "2").exit_code == 0
    with output_lock(str(out)):
        result = invoke("merge", *parts, "-o", out)
    assert result.exit_code == 2 and "another prefixcache process" in result.output, result.output
    assert not out.exists()

@pytest.mark.slow

def test_two_processes_on_one_output_one_is_refused_the_other_completes(tmp_path, tiny_model_dir):
    import os

    from prefixcache.data.lock import lock_path

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 40), tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "prefixcache", "run", str(spec), str(items), "-o", str(out), "-q", "--batch-size", "1"]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (lock_path(out).exists() and lock_path(out).read_text()) and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGSTOP)  # the first run, caught holding its lock
    try:
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert second.returncode == 2 and f"(pid {first.pid}, since" in second.stderr, second.stderr
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == list(range(40)) and not lock_path(out).exists()


# -- merging parts of different jobs -----------------------------------------------------------
@pytest.mark.parametrize("second, message", [
    (("--limit", "5"), "different item count (--limit)"),
    (("--keep", "text"), "different --keep"),
    (("--batch-size", "3"), "different --batch-size"),
])
def test_merge_refuses_parts_written_with_other_options(tmp_path, tiny_model_dir, second, message):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 8)
    parts = [tmp_path / "p1.csv", tmp_path / "p2.csv"]
    assert invoke("run", spec, items, "-o", parts[0], "--shard", "1/2", "-q", "--batch-size", "2").exit_code == 0
    assert invoke("run", spec, items, "-o", parts[1], "--shard", "2/2", "-q", "--batch-size", "2", *second).exit_code == 0
    result = invoke("merge", *parts, "-o", tmp_path / "merged.csv")
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "merged.csv").exists()


def test_merge_refuses_parts_that_do_not_cover_the_job(tmp_path, tiny_model_dir):
    from prefixcache.data.output import fingerprint_path

    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 8)
    parts = [tmp_path / "p1.jsonl", tmp_path / "p2.jsonl"]
    for k, part in enumerate(parts, 1):
        assert invoke("run", spec, items, "-o", part, "--shard", f"{k}/2", "-q", "--batch-size", "2").exit_code == 0
    info = json.loads(fingerprint_path(str(parts[0])).read_text())
    assert info["of"] == 8
    result = invoke("merge", *parts, "-o", tmp_path / "merged.jsonl")
    assert result.exit_code == 0 and len((tmp_path / "merged.jsonl").read_text().splitlines()) == 8


# -- a report or gate file named like a file the command reads --------------------------------
@pytest.mark.parametrize("option, target", [
    ("--metrics", "ITEMS"), ("--junit", "SPEC"), ("--summary-md", "OUT"), ("--metrics", "--junit"),
])
def test_report_files_may_not_name_the_input_the_spec_or_the_output(tmp_path, option, target):
    spec, items, out = write_spec(tmp_path, labels=LABELS3, gold="label"), tmp_path / "i.jsonl", tmp_path / "out.jsonl"
    items.write_text(json.dumps({"id": 1, "text": "a", "label": "billing"}) + "\n")
    files = {"ITEMS": items, "SPEC": spec, "OUT": out, "--junit": tmp_path / "same.xml"}
    before = {p: p.read_bytes() for p in (items, spec)}
    extra = ["--junit", files["--junit"]] if target == "--junit" else []
    result = invoke("run", spec, items, "-o", out, option, files[target], *extra)
    assert result.exit_code == 2 and "write it to another file" in result.output, result.output
    assert {p: p.read_bytes() for p in (items, spec)} == before


def test_report_and_diff_refuse_to_write_over_what_they_read(tmp_path):
    from helpers import A, B, write_records

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_records(a, A)
    write_records(b, B)
    before = a.read_bytes()
    for args in (("report", a, "-o", a, "--overwrite"), ("report", a, "--compare", b, "-o", b),
                 ("diff", a, b, "--json", a), ("diff", a, b, "--md", b)):
        result = invoke(*args)
        assert result.exit_code == 2 and "write it to another file" in result.output, (args, result.output)
    assert a.read_bytes() == before


# -- CSV outputs read back whole ----------------------------------------------------------------
def test_a_csv_output_with_a_huge_kept_value_reads_back_whole(tmp_path, tiny_model_dir):
    from prefixcache.data.output import read_records

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "i.jsonl", tmp_path / "o.csv"
    items.write_text("".join(json.dumps({"id": k, "text": "refund", "note": "x" * (200_000 if k == 1 else 3)}) + "\n"
                             for k in range(3)))
    assert invoke("run", spec, items, "-o", out, "--keep", "note", "-q").exit_code == 0
    assert [r["id"] for r in read_records(str(out)).records] == ["0", "1", "2"]
    before = out.read_bytes()
    result = invoke("run", spec, items, "-o", out, "--keep", "note", "--resume")
    assert result.exit_code == 0 and "nothing to do" in result.output and out.read_bytes() == before, result.output


def test_newlines_in_column_names_and_labels_read_back(tmp_path, tiny_model_dir):
    from prefixcache.data.output import read_records

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["bill\ning", "tech"])
    items, out = tmp_path / "i.jsonl", tmp_path / "o.csv"
    items.write_text("".join(json.dumps({"id": k, "text": "refund", "a\nb": "c"}) + "\n" for k in range(3)))
    assert invoke("run", spec, items, "-o", out, "--keep-all", "-q").exit_code == 0
    records = read_records(str(out)).records
    assert len(records) == 3 and set(records[0]["probs"]) == {"bill\ning", "tech"} and records[0]["a\nb"] == "c"
    assert invoke("diff", out, out).exit_code == 0


def test_a_kept_column_named_like_a_per_label_column_is_refused_in_csv(tmp_path, tiny_model_dir):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "i.jsonl"
    items.write_text(json.dumps({"id": 1, "text": "refund", "prob_other": "0.9"}) + "\n")
    result = invoke("run", spec, items, "-o", tmp_path / "o.csv", "--keep", "prob_other")
    assert result.exit_code == 2 and "named like the record's per-label CSV columns" in result.output, result.output
    assert invoke("run", spec, items, "-o", tmp_path / "o.jsonl", "--keep", "prob_other", "-q").exit_code == 0


@pytest.mark.parametrize("content", ['{"id": 1}\n', 'not json\n', '{"id": 1, "label": "a", "error": 3}\n',
                                     '{"id": 1, "label": "a", "probs": "high"}\n', '{"id": [1], "label": "a"}\n'])
def test_diff_and_report_refuse_what_is_not_a_record(tmp_path, content):
    from helpers import A, write_records

    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    write_records(good, A)
    bad.write_text(content)
    for args in (("diff", bad, good), ("diff", good, bad), ("report", bad, "-o", tmp_path / "r.html")):
        result = invoke(*args)
        assert result.exit_code == 2 and "is not a record" in result.output, (args, result.output)


@pytest.mark.parametrize("what", ["missing", "folder"])
def test_diff_and_report_on_a_missing_file_or_a_folder(tmp_path, what):
    from helpers import A, write_records

    good, target = tmp_path / "good.jsonl", tmp_path / "other"
    write_records(good, A)
    if what == "folder":
        target.mkdir()
    for args in (("diff", good, target), ("report", target, "-o", tmp_path / "r.html")):
        result = invoke(*args)
        assert result.exit_code == 2 and ("no such file" in result.output or "is a directory" in result.output), result.output


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_full_disk_on_the_output_is_exit_2_naming_it(full_disk, tmp_path, tiny_model_dir, fmt):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 400)
    out = full_disk / f"o.{fmt}"
    result = invoke("run", spec, items, "-o", out, "-q")
    assert result.exit_code == 2 and f"{out}: cannot write the output: No space left on device" in result.output, result.output


def test_diff_shows_ids_and_labels_as_they_are(tmp_path):
    a, b = _hostile_runs(tmp_path)
    md = tmp_path / "diff.md"
    result = invoke("diff", a, b, "--md", md, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "[link=https://evil.example]click[/link]" in result.stdout and "[bold]x[/bold]" in result.stdout
    rows = [line for line in md.read_text().splitlines() if line.startswith("| ")]
    for row in rows:  # every row has as many cells as its table's header
        cells = len(row.replace("\\|", "").split("|")) - 2
        assert cells in (3, 4, 6), row
    assert "\\$5 off \\$20" in md.read_text() and "R&amp;D &lt;team&gt;" in md.read_text()


def test_junit_and_the_report_take_any_label(tmp_path):
    import xml.dom.minidom

    from prefixcache.reports.evaluation import Evaluation, Gates
    from prefixcache.reports.htmlpage import build_report

    ev = Evaluation(HOSTILE_LABELS + ["bell\x07"])
    for label in HOSTILE_LABELS:
        ev.add(label, HOSTILE_LABELS[0], prob=0.6)
    xml.dom.minidom.parseString(ev.to_junit(Gates(0.9, 0.5)))  # well-formed
    a, _ = _hostile_runs(tmp_path)
    page = build_report(str(a))
    assert "$5 off $20" in page and "R&amp;D &lt;team&gt;" in page


def test_keep_all_on_stdin_never_lets_a_field_override_the_record(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3, id_field="ticket")
    good = json.dumps({"ticket": "t0", "text": "refund", "x": 1})
    line = json.dumps({"ticket": "t1", "text": "refund", "error": "fake", "label": "billing", "x": 1})
    result = invoke("run", spec, "-", "--format", "jsonl", "--keep-all", input=good + "\n" + line + "\n")
    assert result.exit_code == 2, result.output  # refused, as the same field in a file is refused before the run
    record, = [json.loads(x) for x in result.stdout.splitlines()]
    assert record["id"] == "t0" and record["x"] == 1 and "error" not in record
    assert "item t1: --keep-all cannot keep the input field 'error'" in result.stderr
    file = tmp_path / "i.jsonl"
    file.write_text(line + "\n")
    assert invoke("run", spec, file, "--keep-all").exit_code == 2


def test_merge_into_an_existing_file_names_only_its_own_option(tmp_path):
    out = tmp_path / "merged.jsonl"
    out.write_text("x\n")
    result = invoke("merge", tmp_path / "p1.jsonl", "-o", out)
    assert result.exit_code == 2 and "use --overwrite to replace it" in result.output and "--resume" not in result.output


def test_merge_refuses_mixed_formats(spec_path, tmp_path):
    src = jsonl_of_ids(tmp_path / "in.jsonl", [f"m{k}" for k in range(6)])
    a, b = tmp_path / "a.jsonl", tmp_path / "b.csv"
    assert invoke("run", spec_path, src, "-o", a, "--shard", "1/2", "-q").exit_code == 0
    assert invoke("run", spec_path, src, "-o", b, "--shard", "2/2", "-q").exit_code == 0
    for output in ("all.jsonl", "all.csv"):
        result = invoke("merge", a, b, "-o", tmp_path / output)
        assert result.exit_code == 2
        assert result.stderr == "error: the parts and the output must all be .jsonl or all .csv (got .csv, .jsonl)\n"
        assert not (tmp_path / output).exists()


def test_a_planted_link_at_a_temporary_name_is_never_followed(spec_path, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.prefixcache.json.tmp").symlink_to(victim)  # the name older versions wrote to
    assert invoke("run", spec_path, jsonl_of_ids(tmp_path / "in.jsonl", ["x"]), "-o", out, "-q").exit_code == 0
    assert victim.read_text() == "precious"
    assert json.loads((tmp_path / "out.jsonl.prefixcache.json").read_text())["batch_size"] == 64


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_output_is_refused(spec_path, tmp_path, dangling):
    target = tmp_path / "elsewhere" / "target.jsonl"
    target.parent.mkdir()
    if not dangling:
        target.write_text("someone else's file\n")
    link = tmp_path / "out.jsonl"
    link.symlink_to(target)
    result = invoke("run", spec_path, jsonl_of_ids(tmp_path / "in.jsonl", ["x"]), "-o", link, "--overwrite")
    assert result.exit_code == 2
    assert result.stderr == f"error: {link}: is a symbolic link; name the file itself (prefixcache never writes through a link)\n"
    assert target.exists() != dangling and (dangling or target.read_text() == "someone else's file\n")


def test_refuses_to_overwrite(spec_four_labels, tmp_path):
    src = write_texts(tmp_path / "in.jsonl", ticket_texts(3))
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    result = invoke("run", spec_four_labels, src, "-o", out)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {out}: already exists; use --resume to continue it, --update to bring it up "
                             "to date with the input, or --overwrite to replace it\n")
    assert out.read_text() == "precious\n"
    assert invoke("run", spec_four_labels, src, "-o", out, "--overwrite", "-q").exit_code == 0
    assert len(_records(out)) == 3


def test_on_error_skip_writes_error_records(spec_four_labels, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "body": "no text"}\n{"id": "c", "text": "also fine"}\n')
    out = tmp_path / "out.jsonl"
    result = invoke("run", spec_four_labels, src, "-o", out, "--on-error", "skip")
    assert result.exit_code == 4
    records = _records(out)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert records[1] == {"id": "b", "item_sha": records[1]["item_sha"],
                          "error": "item 'b': lacks field 'text' used by the template"}
    assert "label" in records[0] and "label" in records[2]
    assert "1 items failed (error records written)" in result.stderr
    failed = invoke("run", spec_four_labels, src, "-o", tmp_path / "o2.jsonl")  # fail: refused before the model loads
    assert failed.exit_code == 2 and f"{src}:2: item 'b' lacks field 'text'" in failed.stderr


def test_too_long_item_is_an_error_record_under_skip(spec_four_labels, tmp_path, tiny_model_dir):
    import shutil

    small = tmp_path / "small"
    shutil.copytree(tiny_model_dir, small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 200
    (small / "config.json").write_text(json.dumps(config))
    spec = write_spec(tmp_path, name="small.yaml", model=str(small), labels=["tech", "billing"])
    src = write_texts(tmp_path / "in.jsonl", ["short", "long " * 300, "short too"])
    out = tmp_path / "out.csv"
    result = invoke("run", spec, src, "-o", out, "--on-error", "skip", "-q")
    assert result.exit_code == 4
    lines = out.read_text().splitlines()
    assert lines[0].endswith(",error") and len(lines) == 4
    assert "do not fit the model's context of 200" in lines[2] and lines[2].startswith("i1,")


@pytest.mark.parametrize("link", ["same", "symlink", "hardlink"])
def test_the_output_may_not_be_the_input(spec_three_labels, tmp_path, link):
    src = write_jsonl(tmp_path / "data.jsonl", ticket_rows(range(3)))
    target = src
    if link != "same":
        target = tmp_path / "alias.jsonl"
        (os.symlink if link == "symlink" else os.link)(src, target)
    before = src.read_bytes()
    result = invoke("run", spec_three_labels, src, "-o", target, "--overwrite")
    assert result.exit_code == 2
    assert result.stderr == f"error: {target}: is the input file {src}; write the output to another file\n"
    assert src.read_bytes() == before


def test_failed_items_count_as_items_and_as_wrong(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"], gold="answer")
    rows = [{"id": n, "text": f"ticket {n}", "answer": "tech"} for n in range(4)]
    del rows[2]["text"]
    src, metrics = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "m.json"
    result = invoke("run", spec, src, "-o", tmp_path / "o.jsonl", "--on-error", "skip", "--metrics", metrics)
    assert result.exit_code == 4
    assert "duplicates reused" not in result.stderr
    data = json.loads(metrics.read_text())
    assert (data["items"], data["failed"]) == (4, 1) and data["coverage"] == 0.75
    assert data["correct"] <= 3 and data["accuracy"] == data["correct"] / 4


def test_summary_md_appends_to_an_existing_summary(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"], gold="answer")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": n, "text": f"t {n}", "answer": "tech"} for n in range(3)])
    summary = tmp_path / "step_summary.md"
    summary.write_text("## Earlier step\n")
    for out in ("a.jsonl", "b.jsonl"):
        assert invoke("run", spec, src, "-o", tmp_path / out, "--summary-md", summary, "-q").exit_code == 0
    text = summary.read_text()
    assert text.startswith("## Earlier step\n") and text.count("### prefixcache evaluation") == 2


def test_summary_md_names_the_run_and_each_gate_missed(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"], gold="answer")
    # The same text twice with each gold label: one prediction, so accuracy 0.5 and one label's recall 0.
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": n, "text": "same ticket", "answer": ["tech", "billing"][n]} for n in (0, 1)])
    summary, out = tmp_path / "summary.md", tmp_path / "o.jsonl"
    gated = invoke("run", spec, src, "-o", out, "--summary-md", summary, "--min-accuracy", 0.6, "--min-recall", 0.9, "-q")
    assert gated.exit_code == 5
    text = summary.read_text()
    assert f"spec `{spec}` · model `{tiny_model_dir}` · input `{src}` · output `{out}`" in text
    assert "gates: **FAILED**" in text
    assert "- gate failed: accuracy 0.5000 is below --min-accuracy 0.6" in text
    assert re.search(r"- gate failed: recall of '(tech|billing)' 0.0000 is below --min-recall 0.9", text)


def test_predictions_piled_on_one_label_are_warned_about(spec_three_labels, tmp_path):
    same = write_jsonl(tmp_path / "same.jsonl", [{"id": n, "text": "the same ticket"} for n in range(24)])  # one label
    warned = invoke("run", spec_three_labels, same, "-o", tmp_path / "o.jsonl")
    assert warned.exit_code == 0
    assert "100% of the items (24 of 24) got the label" in warned.stderr and "'calibrate: true'" in warned.stderr
    few = write_jsonl(tmp_path / "few.jsonl", [{"id": n, "text": "the same ticket"} for n in range(5)])
    assert "got the label" not in invoke("run", spec_three_labels, few, "-o", tmp_path / "f.jsonl").stderr  # too few to tell


def test_the_pile_up_warning_looks_at_the_whole_output_not_the_resumed_part(spec_three_labels, tmp_path):
    rows = [{"id": n, "text": "the same ticket" if n >= 10 else f"{WORDS[n]} ticket {n} {WORDS[(n * 7) % 12]}"}
            for n in range(40)]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "o.jsonl"
    first = invoke("run", spec_three_labels, src, "-o", out, "--limit", 10, "-q")
    assert first.exit_code == 0
    labels = {r["label"] for r in json_lines(out)}
    resumed = invoke("run", spec_three_labels, src, "-o", out, "--resume")  # 30 identical items: one label for this part
    assert resumed.exit_code == 0
    pile = max(sum(r["label"] == lab for r in json_lines(out)) for lab in labels | {r["label"] for r in json_lines(out)})
    assert ("got the label" in resumed.stderr) == (pile / 40 >= 0.9)
    assert "of 30)" not in resumed.stderr  # the resumed part alone is never what is judged

