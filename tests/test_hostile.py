"""Inputs, environments and streams that are not the happy path: each ends in one line and a
documented exit code, never "internal error", and a finished run's work is never lost."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import invoke, records as _no_ms, write_spec

from prefixcache.errors import InputError, SpecError
from prefixcache.data.items import scan_items
from prefixcache.task.specfile import load_spec


@pytest.fixture()
def spec_path(tmp_path, tiny_model_dir):
    return write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"])


def _items(tmp_path, n=3, name="in.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"id": f"i{k}", "text": f"ticket {k}"}) + "\n" for k in range(n)))
    return path


@pytest.mark.parametrize("content,message", [
    ('{"id": 1, "text": ' + "[" * 5000 + "]" * 5000 + "}\n", "in.jsonl:1: JSON nested too deeply"),
    ('{"id": "a", "text": "ok"}\n{"id": "b", "text": "half \\ud800 pair"}\n',
     "in.jsonl:2: contains an unpaired surrogate escape (like \\ud800), which is not text"),
    ('{"id": "\\udfff", "text": "x"}\n', "in.jsonl:1: contains an unpaired surrogate escape (like \\ud800), which is not text"),
])
@pytest.mark.parametrize("command", ["run", "render"])
def test_hostile_json_is_one_line(spec_path, tmp_path, content, message, command):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    result = invoke(command, spec_path, src)
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path}/{message}\n"


def test_deeply_nested_yaml_spec(tmp_path):
    spec = tmp_path / "deep.yaml"
    spec.write_text("labels: " + "[" * 5000 + "]" * 5000 + "\n")
    result = invoke("run", spec, _items(tmp_path))
    assert result.exit_code == 2 and result.stderr == f"error: {spec}: YAML nested too deeply\n"


def test_an_item_far_longer_than_the_context_is_refused_before_tokenising(spec_path, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "big", "text": "word " * 200_000}) + "\n" + json.dumps({"id": "ok", "text": "x"}) + "\n")
    out = tmp_path / "o.jsonl"
    result = invoke("run", spec_path, src, "-o", out, "--on-error", "skip", "-q")
    assert result.exit_code == 4
    [big, ok] = [json.loads(line) for line in out.read_text().splitlines()]
    assert big["error"] == "item 'big': its fields hold 1000000 characters, far more than the model's context of 1024 tokens"
    assert ok["label"] in ("tech", "billing")


@pytest.mark.parametrize("value", ["abc", "inf", "nan", "-5"])
def test_bad_store_size_in_the_environment(spec_path, tmp_path, value):
    result = invoke("run", spec_path, _items(tmp_path), env={"PREFIXCACHE_STORE_MAX_MB": value})
    assert result.exit_code == 2
    assert result.stderr == f"error: PREFIXCACHE_STORE_MAX_MB must be a number of megabytes (0 or more), not {value!r}\n"


def test_bad_device_and_world_size_in_the_environment(spec_path, tmp_path):
    result = invoke("run", spec_path, _items(tmp_path), env={"PREFIXCACHE_DEVICE": "gpu9"})
    assert result.exit_code == 2 and result.stderr == "error: unknown device 'gpu9'; use auto, cpu, cuda, cuda:N or mps\n"
    result = invoke("run", spec_path, _items(tmp_path), env={"WORLD_SIZE": "two"})
    assert result.exit_code == 2
    assert result.stderr == "error: WORLD_SIZE is 'two', not a number of processes; unset it unless a launcher sets it\n"


def test_a_full_disk_names_the_output_and_keeps_what_was_written(spec_path, tmp_path, monkeypatch):
    from prefixcache.data import output

    src, out = _items(tmp_path, 6), tmp_path / "o.jsonl"
    real_open = output.open_writer

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

    monkeypatch.setattr(output, "open_writer", open_writer)
    result = invoke("run", spec_path, src, "-o", out, "-b", 1, "-q")
    assert result.exit_code == 2
    assert result.stderr == f"error: {out}: cannot write the output: No space left on device\n"
    monkeypatch.undo()
    assert len(out.read_text().splitlines()) == 2
    resumed = invoke("run", spec_path, src, "-o", out, "-b", 1, "--resume", "-q")  # space freed: continue
    assert resumed.exit_code == 0 and len(out.read_text().splitlines()) == 6


def test_an_unwritable_cache_folder_is_a_warning(spec_path, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    result = invoke("run", spec_path, _items(tmp_path), "--cache-dir", blocked, "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 0, result.output
    assert "prefix store: cannot write" in result.stderr and "continuing without it" in result.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 3


def test_cache_commands_on_a_file_instead_of_a_folder_list_and_remove_nothing(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("x")
    listed = invoke("cache", "list", "--cache-dir", blocked, "--json")
    assert (listed.exit_code, listed.stdout, listed.stderr) == (0, "", "")
    cleared = invoke("cache", "clear", "--cache-dir", blocked)
    assert (cleared.exit_code, cleared.stderr) == (0, "removed 0 stored prefixes\n")
    assert blocked.read_text() == "x"  # nothing touched


def test_help_short_flag_and_choices():
    result = invoke("run", "-h", env={"COLUMNS": "120"})
    assert result.exit_code == 0 and "<fail|skip>" in result.stdout and "<jsonl|csv>" in result.stdout
    assert "<auto|float32|bfloat16|float16>" in result.stdout


def _fuzz_lines(rng: random.Random) -> bytes:
    pieces = [b'{"id": 1, "text": "x"}', b"{", b"}", b"[", b"]", b'"', b"\\", b"\\ud800", b"\\u0000", b"\xff\xfe",
              b"\xef\xbb\xbf", b"\n", b"\r\n", b",", b":", b"null", b"1e999", b"-0", b'"id"', b'"text"', b"\t",
              b"\xe2\x80\xa8", b"'", b"a,b\n", b'"unterminated', b"\x00", b"{" * 50, b"]" * 50]
    return b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv", "json"])
def test_readers_never_fail_with_anything_but_an_input_error(tmp_path, fmt):
    """A seeded fuzz of the readers: whatever the bytes, a clean scan or one InputError."""
    rng = random.Random(1234)
    path = tmp_path / f"fuzz.{fmt}"
    outcomes = {"clean": 0, "refused": 0}
    for _ in range(400):
        path.write_bytes(_fuzz_lines(rng))
        try:
            scan_items(str(path), fmt, "id", lambda record: None)
            outcomes["clean"] += 1
        except InputError as exc:
            assert str(exc).startswith(str(path)), exc  # the error names the file
            outcomes["refused"] += 1
    # the fuzz reaches both ends (random pieces never make a whole strict JSON array: one is added)
    if fmt == "json":
        path.write_bytes(b'[{"id": 1}, {"id": 2}]')
        outcomes["clean"] += scan_items(str(path), fmt, "id", lambda record: None) == 2
    assert outcomes["clean"] and outcomes["refused"], outcomes


def test_spec_loader_never_fails_with_anything_but_a_spec_error(tmp_path):
    rng = random.Random(99)
    pieces = ["labels:", " [a, b]", "\n", "system: ", "'", '"', "{", "}", "&x", "*x", "!!python/object:os.system", ":",
              "- ", "  ", "template: '{text}'", "examples:", "\n  - text: x\n    label: a", "\t", "\x00", "{{", "%",
              "normalize: mean", "choices: c", "threshold: 2", "calibrate: [1]", "id_field: ''", "model: ./nowhere"]
    path = tmp_path / "fuzz.yaml"
    outcomes = {"clean": 0, "refused": 0}
    for _ in range(400):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 25)))
        path.write_text(body if rng.random() < 0.8 else "labels: [a, b]\n" + body.replace("labels:", "x:"))
        try:
            load_spec(path)
            outcomes["clean"] += 1
        except SpecError as exc:
            assert str(exc).startswith(str(path)), exc
            outcomes["refused"] += 1
    assert outcomes["clean"] and outcomes["refused"], outcomes


# -- streams and logs, as a shell and cron see them ------------------------------------------------
def _sh(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _prefixcache() -> str:
    return f"{sys.executable} -m prefixcache"


@pytest.mark.slow
def test_a_closed_stderr_loses_no_report_and_is_no_error(spec_path, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "text": f"t {k}", "answer": "tech"}) + "\n" for k in range(5)))
    gold_spec = write_spec(tmp_path, name="gold.yaml", model=load_spec(spec_path).model, labels=["tech", "billing"],
                           gold="answer")
    done = _sh(f"{_prefixcache()} run {gold_spec} {src} -o out.jsonl --metrics m.json --junit j.xml 2>&1 | head -1; "
               f"exit ${{PIPESTATUS[0]}}", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "m.json").exists() and (tmp_path / "j.xml").exists()
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 5
    head = _sh(f"{_prefixcache()} run {gold_spec} {src} -q | head -1; exit ${{PIPESTATUS[0]}}", tmp_path)
    assert head.returncode == 0 and len(head.stdout.splitlines()) == 1 and head.stderr == ""
    closed = _sh(f"{_prefixcache()} run {gold_spec} {src} -q >&-", tmp_path)
    assert closed.returncode == 2 and closed.stderr == "error: stdout is closed; give an output file with -o\n"


@pytest.mark.slow
def test_a_cron_log_a_person_can_follow(spec_path, tmp_path):
    src = _items(tmp_path, 40)
    run = _sh(f"{_prefixcache()} run {spec_path} {src} -o out.jsonl --update -b 2 --log-interval 1 --log-level debug "
              f"< /dev/null > cron.log 2>&1", tmp_path)
    assert run.returncode == 0
    lines = (tmp_path / "cron.log").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: "
    assert all(re.match(stamp, line) for line in lines), lines
    assert re.match(stamp + f"start: spec {spec_path}, input {src}, output out.jsonl, model ", lines[0])
    assert "40 items to score" in lines[0]
    assert any("batch: 2 records" in line for line in lines)  # --log-level debug: one line a batch
    assert re.match(stamp + r"done: 40 records to out.jsonl \((tech|billing) \d+(, (tech|billing) \d+)?\); 40 items in",
                    lines[-1])


@pytest.mark.slow
def test_a_cron_update_log_says_what_it_checks_counts_what_it_scored_and_stamps_every_line(spec_path, tmp_path):
    src = _items(tmp_path, 12)
    assert invoke("run", spec_path, src, "-o", tmp_path / "out.jsonl", "-q").exit_code == 0  # the earlier run
    lines = src.read_text().splitlines()
    lines[3] = lines[3].replace("ticket", "changed ticket")
    src.write_text("\n".join(lines) + "\n")
    run = _sh(f"{_prefixcache()} run {spec_path} {src} -o out.jsonl --update < /dev/null > cron.log 2>&1", tmp_path)
    assert run.returncode == 0
    log = (tmp_path / "cron.log").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: "
    assert all(re.match(stamp, line) for line in log), log
    assert "12 items to check (unchanged items keep their records)" in log[0]
    done = re.search(r"done: 12 records to out.jsonl \(([^)]*)\)", log[-1])
    assert done and sum(int(c.split()[-1]) for c in done.group(1).split(", ")) == 1  # one item was scored


def test_a_stop_by_sigterm_is_not_called_ctrl_c(capsys):
    from prefixcache.cli.terminal import Reporter

    reporter = Reporter(quiet=False, interval=30)
    reporter.stopping(signal.SIGTERM)
    said = capsys.readouterr().err
    assert "stopping after this batch (send SIGTERM again to abort)" in said and "Ctrl-C" not in said


def test_ctrl_c_while_loading_stops_at_once_and_while_scoring_says_it_waits_for_the_batch(capsys):
    import signal as signals_module

    from prefixcache.errors import Interrupted
    from prefixcache.run.job import Event
    from prefixcache.cli.terminal import Reporter, signals

    reporter = Reporter(quiet=False, interval=30)
    with signals(reporter) as stopped:
        with pytest.raises(Interrupted, match="^interrupted by SIGINT: stopped before any record was written$"):
            os.kill(os.getpid(), signals_module.SIGINT)
        assert stopped == []
        reporter(Event("scoring", 0, 10))
        os.kill(os.getpid(), signals_module.SIGINT)
        assert stopped == [signals_module.SIGINT]
    reporter.bar.stop()
    assert "stopping after this batch (Ctrl-C again to abort)" in capsys.readouterr().err


# -- damaged outputs and parts: resume and merge either finish correctly or refuse in one line ----------
def _damage(data: bytes, rng: random.Random) -> bytes:
    lines = data.split(b"\n")[:-1]
    kind = rng.choice(["truncate", "garbage-tail", "garbage-line", "duplicate", "delete", "foreign", "swap"])
    if kind == "truncate":
        return data[: rng.randint(0, len(data))]
    if kind == "garbage-tail":
        return data + bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 40)))
    k = rng.randrange(len(lines))
    if kind == "garbage-line":
        lines.insert(k, bytes(rng.choice(b'{}[]":,ab\\ 01') for _ in range(rng.randint(1, 30))))
    elif kind == "duplicate":
        lines.insert(k, lines[k])
    elif kind == "delete":
        del lines[k]
    elif kind == "foreign":
        lines.insert(k, b'{"name": "not a record"}')
    else:
        j = rng.randrange(len(lines))
        lines[k], lines[j] = lines[j], lines[k]
    return b"\n".join(lines) + b"\n"



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
        out.write_bytes(_damage(full.read_bytes(), rng))
        Path(f"{out}.prefixcache.json").write_bytes(Path(f"{full}.prefixcache.json").read_bytes())
        result = invoke("run", spec_path, src, "-o", out, "-b", 3, "--resume", "-q")
        assert result.exit_code in (0, 2), (case, result.output)
        if result.exit_code == 0:
            assert _no_ms(out) == want, case  # complete and exactly the uninterrupted run's records
        else:
            assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
        outcomes.add(result.exit_code)
    assert outcomes == {0, 2}


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
        parts[victim].write_bytes(_damage(good[victim], rng))
        merged = tmp_path / f"merged{case}.jsonl"
        result = invoke("merge", *parts, "-o", merged)
        assert result.exit_code in (0, 2), result.output
        if result.exit_code == 0:
            assert _no_ms(merged) == _no_ms(whole), case
        else:
            assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ") and not merged.exists()
        parts[victim].write_bytes(good[victim])


@pytest.mark.slow
def test_records_reach_stdout_while_the_progress_bar_is_on_a_terminal(spec_path, tmp_path):
    """`run SPEC ITEMS > out.jsonl` at a terminal: stderr is a terminal (the bar is drawn there),
    stdout a file; every record reaches the file and none is drawn on the screen."""
    import pty

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "text": f"ticket {k}"}) + "\n" for k in range(7)))
    out = tmp_path / "out.jsonl"
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}
    env.pop("NO_COLOR", None)
    with out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "prefixcache", "run", str(spec_path), str(src), "-b", "2"],
                                stdout=stdout, stderr=follower, stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    screen = b""
    while True:  # read the screen as it is drawn (a full terminal buffer would block the run)
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the run exited and closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(leader)
    proc.wait(timeout=300)
    assert proc.returncode == 0, screen.decode(errors="replace")[-2000:]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(7))
    assert b"classifying" in screen and b'"label"' not in screen  # the bar on the screen, the records in the file


def test_progress_on_a_resume_counts_what_was_written_before(capsys):
    from prefixcache.cli.terminal import Reporter
    from prefixcache.run.job import Event

    reporter = Reporter(quiet=False, interval=0)
    reporter(Event("scoring", 0, 301, detail="spec s", already=35))
    reporter(Event("batch", 64, 301, rate=3.2, already=35))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("start: spec s; 301 items to score")
    assert lines[1].endswith("prefixcache: 99/336 items, 3.2 items/s, ETA 74 s")
