"""Cron- and CI-grade behaviour: bad input, error records, refusing to overwrite, resume after
a crash (SIGKILL) or a signal (SIGTERM), exit codes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import invoke, records as _records, write_spec


WORDS = "crash refund password invoice login error slow payment account screen update billing".split()


def _texts(n: int) -> list[str]:
    return [f"{WORDS[i % 12]} {WORDS[(i * 7) % 12]} number {i} " + "again " * (i % 5) for i in range(n)]


def _write_items(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"id": f"i{n}", "text": t}) + "\n" for n, t in enumerate(texts)))
    return path



@pytest.fixture()
def spec_path(tmp_path, tiny_model_dir):
    return write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "technical", "billing", "account access"])


def test_empty_input_is_an_empty_output(spec_path, tmp_path):
    for name in ("empty.jsonl", "empty.csv"):
        src = tmp_path / name
        src.write_text("")
        out = tmp_path / ("out-" + name)
        result = invoke("run", spec_path, src, "-o", out)
        assert result.exit_code == 0, result.output
        assert "prefixcache: done: 0 records to" in result.stderr.splitlines()[-1]
        assert out.read_text() == ("" if name.endswith("jsonl") else out.read_text().splitlines()[0] + "\n")


def test_refuses_to_overwrite(spec_path, tmp_path):
    src = _write_items(tmp_path / "in.jsonl", _texts(3))
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    result = invoke("run", spec_path, src, "-o", out)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {out}: already exists; use --resume to continue it, --update to bring it up "
                             "to date with the input, or --overwrite to replace it\n")
    assert out.read_text() == "precious\n"
    assert invoke("run", spec_path, src, "-o", out, "--overwrite", "-q").exit_code == 0
    assert len(_records(out)) == 3


def test_on_error_skip_writes_error_records(spec_path, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "body": "no text"}\n{"id": "c", "text": "also fine"}\n')
    out = tmp_path / "out.jsonl"
    result = invoke("run", spec_path, src, "-o", out, "--on-error", "skip")
    assert result.exit_code == 4
    records = _records(out)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert records[1] == {"id": "b", "item_sha": records[1]["item_sha"],
                          "error": "item 'b': lacks field 'text' used by the template"}
    assert "label" in records[0] and "label" in records[2]
    assert "1 items failed (error records written)" in result.stderr
    failed = invoke("run", spec_path, src, "-o", tmp_path / "o2.jsonl")  # fail: refused before the model loads
    assert failed.exit_code == 2 and f"{src}:2: item 'b' lacks field 'text'" in failed.stderr


def test_too_long_item_is_an_error_record_under_skip(spec_path, tmp_path, tiny_model_dir):
    import shutil

    small = tmp_path / "small"
    shutil.copytree(tiny_model_dir, small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 200
    (small / "config.json").write_text(json.dumps(config))
    spec = write_spec(tmp_path, name="small.yaml", model=str(small), labels=["tech", "billing"])
    src = _write_items(tmp_path / "in.jsonl", ["short", "long " * 300, "short too"])
    out = tmp_path / "out.csv"
    result = invoke("run", spec, src, "-o", out, "--on-error", "skip", "-q")
    assert result.exit_code == 4
    lines = out.read_text().splitlines()
    assert lines[0].endswith(",error") and len(lines) == 4
    assert "do not fit the model's context of 200" in lines[2] and lines[2].startswith("i1,")


def test_resume_after_a_partial_write_equals_an_uninterrupted_run(spec_path, tmp_path):
    src = _write_items(tmp_path / "in.jsonl", _texts(40) + _texts(5))  # duplicates across batches too
    full = tmp_path / "full.jsonl"
    assert invoke("run", spec_path, src, "-o", full, "-b", 4, "-q").exit_code == 0
    part = tmp_path / "part.jsonl"
    assert invoke("run", spec_path, src, "-o", part, "-b", 4, "-q").exit_code == 0
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:13]) + lines[13][:25])  # a crash mid-record
    result = invoke("run", spec_path, src, "-o", part, "-b", 4, "--resume")
    assert result.exit_code == 0, result.output
    assert "dropped a partial last record" in result.stderr and "13 items already done" in result.stderr
    assert _records(part) == _records(full)
    again = invoke("run", spec_path, src, "-o", part, "-b", 4, "--resume", "-q")  # nothing left: no change
    assert again.exit_code == 0 and _records(part) == _records(full)


def test_resume_refuses_another_spec_input_or_a_missing_fingerprint(spec_path, tmp_path, tiny_model_dir):
    src = _write_items(tmp_path / "in.jsonl", _texts(4))
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec_path, src, "-o", out, "-q").exit_code == 0
    other = write_spec(tmp_path, name="other.yaml", model=str(tiny_model_dir), labels=["x", "y"])
    result = invoke("run", other, src, "-o", out, "--resume")
    assert result.exit_code == 2
    assert result.stderr == (f"error: {out}: cannot continue it: it was written with another version of the spec "
                             "file; restore it to continue it, or choose another output file\n")
    changed = _write_items(tmp_path / "in.jsonl", list(reversed(_texts(4))))
    refused = invoke("run", spec_path, changed, "-o", out, "--resume")
    assert refused.exit_code == 2
    assert refused.stderr == (f"error: {out}: cannot resume it: {changed} changed since it was written (not only "
                              "grew); --update keeps the records of unchanged items and scores new and changed ones\n")
    (tmp_path / "out.jsonl.prefixcache.json").unlink()
    assert "fingerprint of the run that wrote it) is missing" in invoke("run", spec_path, changed, "-o", out, "--resume").stderr


def test_same_input_same_records(spec_path, tmp_path):
    src = _write_items(tmp_path / "in.jsonl", _texts(12))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert invoke("run", spec_path, src, "-o", a, "-q").exit_code == 0
    assert invoke("run", spec_path, src, "-o", b, "-q").exit_code == 0
    assert _records(a) == _records(b)


def test_bad_options(spec_path, tmp_path):
    src = _write_items(tmp_path / "in.jsonl", _texts(2))
    bad = invoke("run", spec_path, src, "--on-error", "ignore")
    text = " ".join(bad.stderr.replace("│", " ").split())
    assert bad.exit_code == 2 and "'ignore' is not one of 'fail', 'skip'" in text  # the choices, as --help shows
    assert invoke("run", spec_path, src, "--resume").stderr == "error: --resume needs an output file (-o)\n"
    assert invoke("run", spec_path, src, "--log-level", "loud").exit_code == 2


def _cli(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prefixcache", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.slow
def test_spec_errors_do_not_import_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("labels: [a]\nlables: [b]\n")
    code = ("import sys; from prefixcache.cli.app import app\n"
            "try:\n    app(['run', sys.argv[1], 'x.jsonl'])\nexcept SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True)
    assert out.stdout.strip() == "2 False False"
    assert out.stderr == f"error: {bad}: unknown key 'lables'; did you mean 'labels'?\n"


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().count("\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("no records appeared")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killed_run_resumes_to_the_uninterrupted_output(spec_path, tmp_path, how):
    src = _write_items(tmp_path / "in.jsonl", _texts(300))
    full = tmp_path / "full.jsonl"  # the uninterrupted run (in-process: only the killed run needs a process)
    assert invoke("run", spec_path, src, "-o", full, "-b", 2, "-q").exit_code == 0
    out = tmp_path / "out.jsonl"
    proc = _cli("run", spec_path, src, "-o", out, "-b", 2, "-q")
    _wait_for_lines(out, 20, proc)
    proc.send_signal(getattr(signal, how))
    code = proc.wait(timeout=60)
    written = out.read_text().count("\n")
    assert 20 <= written < 300, "the run must have been stopped part-way"
    if how == "SIGTERM":
        assert code == 143
        assert f"interrupted by SIGTERM: {written} records written to {out} by this run; resume with:" in proc.stderr.read()
    else:
        assert code == -9
    resumed = invoke("run", spec_path, src, "-o", out, "-b", 2, "--resume", "-q")
    assert resumed.exit_code == 0, resumed.output
    assert _records(out) == _records(full)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", b'{"id": 1, "text": "ok"}\n{"id": 2, "text": oops}\n',
         "{path}:2: malformed JSON: Expecting value (column 19)"),
        ("bad.jsonl", b'{"id": 1, "text": "ok"}\n{"id": 2, "text": "\xff"}\n',
         "{path}:2: not valid UTF-8 (byte 20 of the line)"),
        ("bad.jsonl", b'{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n', "{path}:2: duplicate id 1 (first on line 1)"),
        ("bad.csv", b"id,text\n1,a,b\n", "{path}:2: expected 2 columns, found 3"),
        ("bad.csv", b'id,text\nc1,"never closed\nc2,x\nc3,y\n', "{path}:2: a quoted field opened in this row is never closed"),
        ("bad.jsonl", b'{"id": "n", "text": null}\n', "{path}:1: item 'n' has no value in field 'text' (used by the template): null"),
        ("blank.csv", b'id,text\nc1,hello\nc2,\n', "{path}:3: item 'c2' has nothing to classify: its 'text' is empty"),
        ("bad.jsonl", b'{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n', "{path}:2: duplicate id '1' (first on line 1)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(spec_path, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    result = invoke("run", spec_path, path, "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2
    assert result.stderr == "error: " + message.format(path=path) + "\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_quirky_csv_works(spec_path, tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes('\ufeffid,text\n1,"crash, again"\n2,"refund\nplease"\n'.encode())
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec_path, path, "-o", out, "-q").exit_code == 0
    assert [r["id"] for r in _records(out)] == ["1", "2"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("labels: [a, b\n", "{path}:2:1: YAML syntax error: expected ',' or ']', but got '<stream end>'"),
        ("labels: []\n", "{path}: 'labels' is empty"),
        ("labels: [a, a]\n", "{path}: label 'a' is listed twice"),
        ("labels: [a]\ncolor: red\n", "{path}: unknown key 'color'; known keys: model, revision, system, labels, examples, template, "
                                      "id_field, format, normalize, answer_prefix, choices, score_by, gold, calibrate, threshold, trust_remote_code, multi_label, question, answers, gold_sep"),
    ],
)
def test_bad_spec_is_one_line_and_exit_2(tmp_path, text, message):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    items = _write_items(tmp_path / "in.jsonl", _texts(2))
    result = invoke("run", path, items)
    assert result.exit_code == 2
    assert result.stderr == "error: " + message.format(path=path) + "\n"


def test_a_resume_with_nothing_to_do_loads_no_model_stack(tmp_path, tiny_model_dir):
    """A cron `--resume` of a finished output answers before torch or transformers load."""
    import subprocess
    import sys

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


def test_a_second_ctrl_c_while_the_first_stop_unwinds_prints_no_traceback(tmp_path):
    """The first Ctrl-C stops the run and says so; the signal handler is gone then, so a second one
    raises KeyboardInterrupt wherever the unwinding is, even outside the command's own handling
    (seen in typer's main): it ends with exit 130 and one line, never a Python traceback."""
    import subprocess
    import sys

    code = ("import sys, typer.core\n"
            "def unwinding(self, *args, **kwargs):\n"
            "    print('interrupted by SIGINT: stopped before any record was written', file=sys.stderr)\n"
            "    raise KeyboardInterrupt\n"
            "typer.core.TyperGroup.main = unwinding\n"
            "from prefixcache.cli import main\n"
            "sys.argv = ['prefixcache', 'cache', 'list']\n"
            "main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.splitlines() == ["interrupted by SIGINT: stopped before any record was written", "interrupted"]
