"""Continuing an output: --resume after a stop or a crash, an input that grew or changed
(--update), streams on stdin, and the checks that refuse to mix runs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
import pytest
from helpers import invoke, records as _no_ms, write_spec
from prefixcache.errors import Interrupted
import threading
from helpers import records as _records
from prefixcache.run.job import run_job
from prefixcache.run.options import RunOptions, command_line
from helpers import LABELS3, damage, json_lines, jsonl_of_ids, refund_items_file, ticket_rows, ticket_texts, write_jsonl, write_texts


# -- what comes through a pipe ---------------------------------------------------------------
def _piped(tmp_path: Path, text: str) -> Path:
    """A FIFO that gives `text` to its first reader (a spec given as `<(cat spec.yaml)`)."""

    fifo = tmp_path / f"fifo-{len(list(tmp_path.glob('fifo-*')))}"
    os.mkfifo(fifo)
    threading.Thread(target=fifo.write_text, args=(text,), daemon=True).start()
    return fifo


def test_resume_on_a_damaged_output_finishes_correctly_or_refuses(spec_path, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{k}", "text": f"ticket {k} {'again ' * (k % 3)}"}) + "\n"
                           for k in range(12)))
    full = tmp_path / "full.jsonl"
    assert invoke("run", spec_path, src, "-o", full, "-b", 3, "-q").exit_code == 0
    want = _no_ms(full)
    rng = random.Random(7)
    outcomes = set()
    for case in range(30):
        out = tmp_path / f"out{case}.jsonl"
        out.write_bytes(damage(full.read_bytes(), rng))
        Path(f"{out}.prefixcache.json").write_bytes(Path(f"{full}.prefixcache.json").read_bytes())
        result = invoke("run", spec_path, src, "-o", out, "-b", 3, "--resume", "-q")
        assert result.exit_code in (0, 2), (case, result.output)
        if result.exit_code == 0:
            assert _no_ms(out) == want, case  # complete and exactly the uninterrupted run's records
        else:
            assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
        outcomes.add(result.exit_code)
    assert outcomes == {0, 2}


# -- an export read while it was being written -------------------------------------------------
@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_a_half_written_last_item_is_scored_again_when_the_export_grows(tmp_path, tiny_model_dir, fmt):
    spec, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "out.jsonl"
    rows = [("T1", "I was charged twice"), ("T2", "The app crashes"), ("T3", "My card was charged twice for the plan"),
            ("T4", "Password reset mail never arrives")]
    if fmt == "csv":
        lines = ["id,text"] + [f"{i},{t}" for i, t in rows]
    else:
        lines = [json.dumps({"id": i, "text": t}) for i, t in rows]
    whole = "\n".join(lines) + "\n"
    export = tmp_path / f"export.{fmt}"
    cut = whole.index("charged twice for the plan") + len("charged") if fmt == "csv" else None
    export.write_text(whole[:cut] if cut else "\n".join(lines[:3]) + "\n")  # CSV: T3 cut mid-text
    assert invoke("run", spec, export, "-o", out, "-q").exit_code == 0
    export.write_text(whole)
    resumed = invoke("run", spec, export, "-o", out, "--resume")
    if fmt == "csv":
        assert resumed.exit_code == 2 and "item 'T3' changed" in resumed.output and "--update" in resumed.output
        result = invoke("run", spec, export, "-o", out, "--update", "-q")
        assert result.exit_code == 0, result.output
    else:
        assert resumed.exit_code == 0, resumed.output
    fresh = tmp_path / "fresh.jsonl"
    assert invoke("run", spec, export, "-o", fresh, "-q").exit_code == 0
    def decided(path):  # batches differ between the runs: log-probs may differ in the last digits
        return [(r["id"], r["label"], r["item_sha"], {k: round(v, 4) for k, v in r["probs"].items()})
                for r in map(json.loads, path.read_text().splitlines())]

    assert decided(out) == decided(fresh)


def test_a_spec_from_a_pipe_is_fingerprinted_by_its_content(tmp_path, tiny_model_dir):
    a = write_spec(tmp_path, name="a.yaml", model=str(tiny_model_dir), labels=LABELS3).read_text()
    b = write_spec(tmp_path, name="b.yaml", model=str(tiny_model_dir), labels=LABELS3, system="Another.").read_text()
    items, out = refund_items_file(tmp_path / "i.jsonl", 4), tmp_path / "out.jsonl"
    assert invoke("run", _piped(tmp_path, a), items, "-o", out, "-q", "--limit", "2").exit_code == 0
    other = invoke("run", _piped(tmp_path, b), items, "-o", out, "--resume")
    assert other.exit_code == 2 and "another version of the spec file" in other.output, other.output
    same = invoke("run", _piped(tmp_path, a), items, "-o", out, "--resume", "-q")
    assert same.exit_code == 0, same.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2, 3]


def test_resuming_from_stdin_refuses_an_input_of_other_items(tmp_path, tiny_model_dir):
    spec, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "out.jsonl"
    first = "".join(json.dumps({"id": f"a{k}", "text": "refund"}) + "\n" for k in range(3))
    other = "".join(json.dumps({"id": f"b{k}", "text": "crash"}) + "\n" for k in range(5))
    assert invoke("run", spec, "-", "--format", "jsonl", "-o", out, "-q", input=first).exit_code == 0
    result = invoke("run", spec, "-", "--format", "jsonl", "-o", out, "--resume", input=other)
    assert result.exit_code == 2 and "not the input the output was started with" in result.output, result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a0", "a1", "a2"]


# -- --update and --keep-all keep what they should ------------------------------------------
def test_update_tries_error_items_again_and_csv_error_rows_keep_their_fields(tmp_path, tiny_model_dir):
    from prefixcache.data.output import read_records

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3, template="{text} ({product})")
    items, out = tmp_path / "i.jsonl", tmp_path / "o.csv"
    items.write_text("".join(json.dumps({"id": k, "text": "refund", "note": f"n{k}",
                                         **({"product": "app"} if k != 1 else {})}) + "\n" for k in range(3)))
    first = invoke("run", spec, items, "-o", out, "--keep", "note", "--on-error", "skip", "-q")
    assert first.exit_code == 4
    again = invoke("run", spec, items, "-o", out, "--keep", "note", "--on-error", "skip", "--update", "-q")
    assert again.exit_code == 4, again.output  # the item still cannot be scored: said again, not carried silently
    records = read_records(str(out)).records
    assert [r.get("note") for r in records] == ["n0", "n1", "n2"] and "error" in records[1]


# -- what killed writers leave behind ---------------------------------------------------------
def test_an_update_aside_left_by_kill_9_is_removed_by_the_next_run(tmp_path, tiny_model_dir):
    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 3), tmp_path / "out.jsonl"
    assert invoke("run", spec, items, "-o", out, "-q").exit_code == 0
    aside = tmp_path / ".out.jsonl.0f1e2d3c4b5a6978.part"  # as an update killed mid-write leaves it
    fingerprint_tmp = tmp_path / ".out.jsonl.prefixcache.json.a1b2c3d4e5f60718.part"
    mine = [tmp_path / ".out.jsonl.swp", tmp_path / ".out.jsonl.notes"]  # not prefixcache's: they stay
    for path in [aside, fingerprint_tmp, *mine]:
        path.write_text("x")
    assert invoke("run", spec, items, "-o", out, "--update", "-q").exit_code == 0
    assert not aside.exists() and not fingerprint_tmp.exists() and all(p.exists() for p in mine)


def test_csv_resume_keeps_records_whose_ids_hold_line_breaks(spec_path, tmp_path):
    src = jsonl_of_ids(tmp_path / "in.jsonl", ["a\rb", "c\u2028d", "plain", "e\nf"])
    out = tmp_path / "out.csv"
    assert invoke("run", spec_path, src, "-o", out, "-b", 1, "-q").exit_code == 0
    whole = out.read_bytes()
    out.write_bytes(whole[: whole.index(b"\nplain,") + 1])  # the run stopped after two records
    result = invoke("run", spec_path, src, "-o", out, "-b", 1, "--resume")
    assert result.exit_code == 0, result.output
    assert "2 items already done, 2 items in" in result.stderr
    assert out.read_bytes().count(b"\n") == whole.count(b"\n")


def test_a_stream_is_checked_as_it_is_read(spec_path, tmp_path):
    rows = [{"id": f"s{k}", "text": f"ticket {k}"} for k in range(6)]
    text = lambda rs: "".join(json.dumps(r) + "\n" for r in rs)  # noqa: E731
    dup = invoke("run", spec_path, "-", "--format", "jsonl", "-q", input=text(rows[:3] + rows[:1]))
    assert dup.exit_code == 2 and dup.stderr == "error: <stdin>:4: duplicate id 's0' (first on line 1)\n"
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec_path, "-", "--format", "jsonl", "-o", out, "-q", input=text(rows[:3])).exit_code == 0
    other = [{**rows[0], "text": "another ticket"}] + rows[1:5]
    refused = invoke("run", spec_path, "-", "--format", "jsonl", "-o", out, "-q", "--resume", input=text(other))
    assert refused.exit_code == 2
    assert refused.stderr == ("error: <stdin>:1: item 's0' differs from the one already written to the output; "
                              "this is not the input the output was started with\n")
    grown = invoke("run", spec_path, "-", "--format", "jsonl", "-o", out, "-q", "--resume", input=text(rows[:5]))
    assert grown.exit_code == 0 and [r["id"] for r in json_lines(out)] == [f"s{k}" for k in range(5)]
    updated = invoke("run", spec_path, "-", "--format", "jsonl", "-o", out, "--update", input=text(other))
    assert updated.exit_code == 0 and "4 unchanged items kept, 0 dropped, 1 items in" in updated.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_stream_that_fails_before_its_first_record_leaves_nothing_to_block_the_next_run(spec_path, tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    bad = '{"id": "s0", "text": "ok"}\n{"id": "s0", "text": "again"}\n'  # fails in the first batch
    failed = invoke("run", spec_path, "-", "--format", "jsonl", "-o", out, "-q", input=bad)
    assert failed.exit_code == 2 and "duplicate id 's0'" in failed.stderr
    assert not out.exists() and not Path(f"{out}.prefixcache.json").exists()
    fixed = invoke("run", spec_path, "-", "--format", "jsonl", "-o", out, "-q", input=bad.replace('"s0", "text": "again"', '"s1", "text": "x"'))
    assert fixed.exit_code == 0, fixed.output
    assert len(out.read_text().splitlines()) == 2 + (fmt == "csv")


def test_resume_after_a_partial_write_equals_an_uninterrupted_run(spec_four_labels, tmp_path):
    src = write_texts(tmp_path / "in.jsonl", ticket_texts(40) + ticket_texts(5))  # duplicates across batches too
    full = tmp_path / "full.jsonl"
    assert invoke("run", spec_four_labels, src, "-o", full, "-b", 4, "-q").exit_code == 0
    part = tmp_path / "part.jsonl"
    assert invoke("run", spec_four_labels, src, "-o", part, "-b", 4, "-q").exit_code == 0
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:13]) + lines[13][:25])  # a crash mid-record
    result = invoke("run", spec_four_labels, src, "-o", part, "-b", 4, "--resume")
    assert result.exit_code == 0, result.output
    assert "dropped a partial last record" in result.stderr and "13 items already done" in result.stderr
    assert _records(part) == _records(full)
    again = invoke("run", spec_four_labels, src, "-o", part, "-b", 4, "--resume", "-q")  # nothing left: no change
    assert again.exit_code == 0 and _records(part) == _records(full)


def test_resume_refuses_another_spec_input_or_a_missing_fingerprint(spec_four_labels, tmp_path, tiny_model_dir):
    src = write_texts(tmp_path / "in.jsonl", ticket_texts(4))
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec_four_labels, src, "-o", out, "-q").exit_code == 0
    other = write_spec(tmp_path, name="other.yaml", model=str(tiny_model_dir), labels=["x", "y"])
    result = invoke("run", other, src, "-o", out, "--resume")
    assert result.exit_code == 2
    assert result.stderr == (f"error: {out}: cannot continue it: it was written with another version of the spec "
                             "file; restore it to continue it, or choose another output file\n")
    changed = write_texts(tmp_path / "in.jsonl", list(reversed(ticket_texts(4))))
    refused = invoke("run", spec_four_labels, changed, "-o", out, "--resume")
    assert refused.exit_code == 2
    assert refused.stderr == (f"error: {out}: cannot resume it: {changed} changed since it was written (not only "
                              "grew); --update keeps the records of unchanged items and scores new and changed ones\n")
    (tmp_path / "out.jsonl.prefixcache.json").unlink()
    assert "fingerprint of the run that wrote it) is missing" in invoke("run", spec_four_labels, changed, "-o", out, "--resume").stderr


def test_same_input_same_records(spec_four_labels, tmp_path):
    src = write_texts(tmp_path / "in.jsonl", ticket_texts(12))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert invoke("run", spec_four_labels, src, "-o", a, "-q").exit_code == 0
    assert invoke("run", spec_four_labels, src, "-o", b, "-q").exit_code == 0
    assert _records(a) == _records(b)


def test_a_resume_with_nothing_to_do_loads_no_model_stack(tmp_path, tiny_model_dir):
    """A cron `--resume` of a finished output answers before torch or transformers load."""

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"]), tmp_path / "i.jsonl", tmp_path / "o.jsonl"
    items.write_text("".join(json.dumps({"id": k, "text": f"t{k}"}) + "\n" for k in range(3)))
    assert invoke("run", spec, items, "-o", out, "-q").exit_code == 0
    code = ("import sys\nfrom prefixcache.cli import main\n"
            f"sys.argv = ['prefixcache', 'run', {str(spec)!r}, {str(items)!r}, '-o', {str(out)!r}, '--resume']\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
            "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PREFIXCACHE_DEVICE": "cpu"})
    assert done.stdout.strip() == "0 []" and "nothing to do" in done.stderr, (done.stdout, done.stderr[-2000:])


def test_a_stream_that_breaks_off_says_the_records_are_kept_and_how_to_resume(tmp_path, tiny_model_dir):
    spec, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"]), tmp_path / "o.jsonl"
    good = "".join(json.dumps({"id": k, "text": f"t{k}"}) + "\n" for k in range(5))
    result = invoke("run", spec, "-", "--input-format", "jsonl", "-o", out, "-b", "2", input=good + '{"id": 9, oops}\n')
    assert result.exit_code == 2, result.output
    assert "<stdin>:6: malformed JSON" in result.output and "the 4 records before it are kept in" in result.output
    assert "resume with: prefixcache run" in result.output and "--resume" in result.output
    assert len(out.read_text().splitlines()) == 4
    again = invoke("run", spec, "-", "--input-format", "jsonl", "-o", out, "-b", "2", "--resume", input=good)
    assert again.exit_code == 0 and [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(5))


def test_resuming_from_a_shorter_stream_is_refused(tmp_path, tiny_model_dir):
    spec, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=["a", "b"]), tmp_path / "o.jsonl"
    lines = [json.dumps({"id": k, "text": f"t{k}"}) + "\n" for k in range(5)]
    assert invoke("run", spec, "-", "--input-format", "jsonl", "-o", out, input="".join(lines)).exit_code == 0
    before = out.read_bytes()
    result = invoke("run", spec, "-", "--input-format", "jsonl", "-o", out, "--resume", input="".join(lines[:3]))
    assert result.exit_code == 2, result.output
    assert "<stdin>: ended after 3 items, but the output already holds 5 records (the next: item '3')" in result.output
    assert out.read_bytes() == before


def test_resume_continues_an_input_that_only_grew(spec_three_labels, tmp_path):
    src, out = write_jsonl(tmp_path / "in.jsonl", ticket_rows(range(5))), tmp_path / "out.jsonl"
    assert invoke("run", spec_three_labels, src, "-o", out, "-q").exit_code == 0
    first = out.read_bytes()
    write_jsonl(src, ticket_rows(range(8)))
    result = invoke("run", spec_three_labels, src, "-o", out, "--resume")
    assert result.exit_code == 0, result.output
    assert "5 items already done, 3 items in" in result.stderr
    assert out.read_bytes().startswith(first) and [r["id"] for r in json_lines(out)] == [f"t{n}" for n in range(8)]
    done = invoke("run", spec_three_labels, src, "-o", out, "--resume")  # complete: no model load
    assert done.exit_code == 0 and done.stderr.endswith(f"prefixcache: nothing to do: {out} already holds all 8 records\n")


def test_stdin_honours_limit(spec_three_labels, tmp_path):
    data = "".join(json.dumps(r) + "\n" for r in ticket_rows(range(9)))
    result = invoke("run", spec_three_labels, "-", "--format", "jsonl", "-n", 5, "-q", input=data)
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 5


def test_the_resume_hint_is_the_command_with_resume(spec_three_labels, tmp_path):
    src, out = write_jsonl(tmp_path / "items.jsonl", ticket_rows(range(6))), tmp_path / "out.jsonl"
    options = RunOptions(spec_three_labels, str(src), output=str(out), batch_size=2, gold="cat", overwrite=True)
    with pytest.raises(Interrupted) as stopped:
        run_job(options, stop=lambda: signal.SIGINT)
    hint = f"prefixcache run {spec_three_labels} {src} -o {out} --batch-size 2 --gold cat --resume"
    assert str(stopped.value) == f"interrupted by SIGINT: 2 records written to {out} by this run; resume with: {hint}"
    assert command_line(options) == hint
    resumed = invoke(*hint.split()[1:])  # pasted as printed
    assert resumed.exit_code == 0, resumed.output
    assert len(json_lines(out)) == 6


def test_a_refused_resume_names_the_options_to_add_back(spec_three_labels, tmp_path):
    src, out = write_jsonl(tmp_path / "items.jsonl", ticket_rows(range(4))), tmp_path / "out.jsonl"
    assert invoke("run", spec_three_labels, src, "-o", out, "--gold", "cat", "-b", 16, "-q", "--limit", 2).exit_code == 0
    refused = invoke("run", spec_three_labels, src, "-o", out, "--resume")
    assert refused.exit_code == 2
    assert refused.stderr == (f"error: {out}: cannot continue it: it was written with --gold cat and "
                              "--batch-size 16; add them back to continue it, or choose another output file\n")
    assert "--overwrite" not in refused.stderr


def test_gold_added_to_a_written_output_says_exactly_what_to_do(spec_three_labels, tmp_path):
    src, out = write_jsonl(tmp_path / "items.jsonl", ticket_rows(range(4))), tmp_path / "out.jsonl"
    assert invoke("run", spec_three_labels, src, "-o", out, "-q").exit_code == 0
    refused = invoke("run", spec_three_labels, src, "-o", out, "--gold", "cat", "--resume")
    assert refused.exit_code == 2
    other = tmp_path / "out.cat.jsonl"
    assert refused.stderr == (f"error: {out}: was written without a gold field, so its records hold no 'cat' values to "
                              f"evaluate; write the evaluated run to another output (-o {other} --gold cat); or drop "
                              f"--gold cat to continue this one\n")
    followed = invoke("run", spec_three_labels, src, "-o", other, "--gold", "cat", "-q")  # doing as told works
    assert followed.exit_code == 0 and all("correct" in r for r in json_lines(other))


def test_resume_and_overwrite_together_is_a_usage_error(spec_three_labels, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ticket_rows(range(2)))
    result = invoke("run", spec_three_labels, src, "-o", tmp_path / "o.jsonl", "--resume", "--overwrite")
    assert result.exit_code == 2
    assert result.stderr == "error: --overwrite starts the output again; --resume continues it: give one of them\n"


def test_update_drops_items_no_longer_in_the_input_and_an_interrupted_update_changes_nothing(spec_three_labels, tmp_path):
    src, out = write_jsonl(tmp_path / "in.jsonl", ticket_rows(range(6))), tmp_path / "out.jsonl"
    assert invoke("run", spec_three_labels, src, "-o", out, "-q").exit_code == 0
    before = out.read_bytes()
    write_jsonl(src, ticket_rows([0, 1, 2, 7, 8]))
    options = RunOptions(spec_three_labels, str(src), output=str(out), update=True)
    with pytest.raises(Interrupted) as stopped:
        run_job(options, stop=lambda: signal.SIGTERM)
    assert str(stopped.value) == (f"interrupted by SIGTERM: {out} is unchanged; update it with: "
                                  f"prefixcache run {spec_three_labels} {src} -o {out} --update")
    assert out.read_bytes() == before and not list(tmp_path.glob(".out.jsonl.*"))
    result = run_job(options)
    assert (result.kept, result.dropped, result.stats.items) == (3, 3, 2)
    assert [r["id"] for r in json_lines(out)] == ["t0", "t1", "t2", "t7", "t8"]

