"""Stops and logs: SIGTERM, Ctrl-C (once and twice), kills, closed streams, cron logs a person
can follow, the progress bar on a terminal, launches that cannot start."""

from __future__ import annotations

import json
import os
import signal
import re
import subprocess
import sys
from pathlib import Path
import pytest
from helpers import invoke, write_spec
from prefixcache.task.specfile import load_spec
from prefixcache.errors import Interrupted, ModelError
import time
from helpers import free_port
from helpers import records as _records
from prefixcache.run.job import run_job
from prefixcache.run.options import RunOptions
from helpers import items_file, json_lines, jsonl_of_ids, ticket_rows, ticket_texts, write_jsonl, write_texts


# -- streams and logs, as a shell and cron see them ------------------------------------------------
def _sh(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _prefixcache() -> str:
    return f"{sys.executable} -m prefixcache"


def _cli(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prefixcache", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().count("\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("no records appeared")


def _same_scores(got: dict, want: dict) -> None:
    assert got["id"] == want["id"] and got["label"] == want["label"] and got["item_sha"] == want["item_sha"]
    assert max(abs(got["logprobs"][k] - want["logprobs"][k]) for k in want["logprobs"]) < 1e-4


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
    assert closed.returncode == 2 and closed.stderr.endswith(" prefixcache: error: stdout is closed; give an output file with -o\n")


@pytest.mark.slow
def test_a_cron_log_a_person_can_follow(spec_path, tmp_path):
    src = items_file(tmp_path, 40)
    run = _sh(f"{_prefixcache()} run {spec_path} {src} -o out.jsonl --update -b 2 --log-interval 1 --log-level debug "
              f"< /dev/null > cron.log 2>&1", tmp_path)
    assert run.returncode == 0
    lines = (tmp_path / "cron.log").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: "
    assert all(re.match(stamp, line) for line in lines), lines
    lines = [line for line in lines if " prefixcache: backend: " not in line]  # --log-level debug says the engine chosen
    assert re.match(stamp + "memory: .* will take about .* GB", lines[0])  # said before the model loads
    assert re.match(stamp + f"start: spec {spec_path}, input {src}, output out.jsonl, model ", lines[1])
    assert "40 items to score" in lines[1]
    assert any("batch: 2 records" in line for line in lines)  # --log-level debug: one line a batch
    assert re.match(stamp + r"done: 40 records to out.jsonl \((tech|billing) \d+(, (tech|billing) \d+)?\); 40 items in",
                    lines[-1])


@pytest.mark.slow
def test_a_cron_update_log_says_what_it_checks_counts_what_it_scored_and_stamps_every_line(spec_path, tmp_path):
    src = items_file(tmp_path, 12)
    assert invoke("run", spec_path, src, "-o", tmp_path / "out.jsonl", "-q").exit_code == 0  # the earlier run
    lines = src.read_text().splitlines()
    lines[3] = lines[3].replace("ticket", "changed ticket")
    src.write_text("\n".join(lines) + "\n")
    run = _sh(f"{_prefixcache()} run {spec_path} {src} -o out.jsonl --update < /dev/null > cron.log 2>&1", tmp_path)
    assert run.returncode == 0
    log = (tmp_path / "cron.log").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: "
    assert all(re.match(stamp, line) for line in log), log
    assert "12 items to check (unchanged items keep their records)" in log[1]  # after the memory line
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


def test_a_stop_while_a_model_loads_is_a_stop_not_a_model_error(tmp_path, monkeypatch):
    from prefixcache.model import load

    def stopped(*args, **kwargs):
        raise Interrupted(signal.SIGTERM, "interrupted by SIGTERM: stopped before any record was written")

    monkeypatch.setattr(load, "load_weights", stopped)
    source = load.ModelSource("some/model", "hub", "some/model")
    with pytest.raises(Interrupted) as stop:
        load.load_model(source, None, tmp_path)
    assert not isinstance(stop.value, ModelError) and stop.value.exit_code == 143


def test_a_second_signal_stops_at_once_with_its_own_code():
    from prefixcache.run.job import Event
    from prefixcache.cli.terminal import Reporter, signals

    reporter = Reporter(quiet=True, interval=30)
    reporter(Event("scoring", 0, 10))
    with signals(reporter):
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Interrupted) as again:
            os.kill(os.getpid(), signal.SIGTERM)
    assert again.value.exit_code == 143


@pytest.mark.slow
def test_world_size_without_a_launcher_fails_in_bounded_time(spec_path, tmp_path):
    import subprocess
    import sys

    src = jsonl_of_ids(tmp_path / "in.jsonl", ["x"])
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    no_master = subprocess.run([sys.executable, "-m", "prefixcache", "run", str(spec_path), str(src), "-q"],
                               env={**base, "WORLD_SIZE": "2"}, capture_output=True, text=True, timeout=120)
    assert no_master.returncode == 2 and no_master.stderr.endswith(
        "error: WORLD_SIZE is 2 but no launcher started this process (MASTER_ADDR is not set); use accelerate "
        "launch or torchrun, or unset WORLD_SIZE to run one process\n")
    code = "import prefixcache.run.shards as s; s.LAUNCH_TIMEOUT = 3\nfrom prefixcache.cli import main\nmain()"
    env = {**base, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    alone = subprocess.run([sys.executable, "-c", code, "run", str(spec_path), str(src), "-q"], env=env,
                           capture_output=True, text=True, timeout=600)
    assert alone.returncode == 2
    assert "did not all join within 3 s" in alone.stderr.splitlines()[-1]


def test_a_stop_waits_for_the_batch_in_flight_only_so_long(monkeypatch):
    from prefixcache.cli import terminal
    from prefixcache.run.job import Event

    monkeypatch.setattr(terminal, "STOP_GRACE", 0.2)
    reporter = terminal.Reporter(quiet=True, interval=30)
    reporter(Event("scoring", 0, 10))
    with pytest.raises(Interrupted) as abandoned:
        with terminal.signals(reporter):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # a batch that takes too long
    assert abandoned.value.exit_code == 143
    assert str(abandoned.value) == ("interrupted by SIGTERM: the batch in flight did not finish within 0 s and was "
                                    "abandoned; finished records are kept (--resume continues)")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killed_run_resumes_to_the_uninterrupted_output(spec_four_labels, tmp_path, how):
    src = write_texts(tmp_path / "in.jsonl", ticket_texts(300))
    full = tmp_path / "full.jsonl"  # the uninterrupted run (in-process: only the killed run needs a process)
    assert invoke("run", spec_four_labels, src, "-o", full, "-b", 2, "-q").exit_code == 0
    out = tmp_path / "out.jsonl"
    proc = _cli("run", spec_four_labels, src, "-o", out, "-b", 2, "-q")
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
    resumed = invoke("run", spec_four_labels, src, "-o", out, "-b", 2, "--resume", "-q")
    assert resumed.exit_code == 0, resumed.output
    assert _records(out) == _records(full)


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


def test_cron_recipe_on_a_growing_file_then_a_reordered_re_export(spec_three_labels, tmp_path):
    """The documented cron command, run as the input grows and then as a re-export comes in a new
    order with one item changed: each run scores only what is new or changed, and the output ends
    equal to a fresh full run on the final input."""
    src, out = tmp_path / "today.jsonl", tmp_path / "out.jsonl"
    cron = ["run", spec_three_labels, src, "-o", out, "--update", "--on-error", "skip", "-b", 4]
    scored = []
    for ids in (range(0, 7), range(0, 10), range(0, 16)):  # the file grows between runs
        write_jsonl(src, ticket_rows(ids))
        result = invoke(*cron)
        assert result.exit_code == 0, result.output
        scored.append(int(result.stderr.split(" items in ")[0].split()[-1]))
    assert scored == [7, 3, 6]
    assert [r["id"] for r in json_lines(out)] == [f"t{n}" for n in range(16)]

    export = list(reversed(ticket_rows(range(0, 18))))  # a fresh export: new order, two new items ...
    export[5] = {**export[5], "text": export[5]["text"] + " (edited)"}  # ... and one changed
    write_jsonl(src, export)
    result = invoke(*cron)
    assert result.exit_code == 0, result.output
    assert "15 unchanged items kept, 0 dropped, 3 items in" in result.stderr  # t16, t17 and the edited t12
    fresh = tmp_path / "fresh.jsonl"
    assert invoke("run", spec_three_labels, src, "-o", fresh, "-b", 4, "-q").exit_code == 0
    got, want = json_lines(out), json_lines(fresh)
    assert [r["id"] for r in got] == [r["id"] for r in export]  # every item once, in the export's order
    for g, w in zip(got, want, strict=True):
        _same_scores(g, w)
    assert not list(tmp_path.glob(".out.jsonl.*"))  # no file left aside
    again = invoke(*cron)  # nothing changed: no model load, nothing rewritten
    assert again.exit_code == 0 and again.stderr.endswith(f"prefixcache: nothing to do: {out} already holds all 18 records\n")
    assert len(again.stderr.splitlines()) == 1


def test_a_batch_abandoned_after_a_stop_still_prints_the_resume_command(spec_three_labels, tmp_path):
    """The signal handler gives up on a slow batch by raising from inside it; the command to go on
    is printed all the same."""
    src, out = write_jsonl(tmp_path / "items.jsonl", ticket_rows(range(6))), tmp_path / "out.jsonl"
    options = RunOptions(spec_three_labels, str(src), output=str(out), batch_size=2)
    abandoned = "interrupted by SIGINT: the batch in flight did not finish within 10 s and was abandoned"

    def slow_batch(event):
        if event.phase == "batch" and event.written == 4:
            raise Interrupted(signal.SIGINT, abandoned)

    with pytest.raises(Interrupted) as stopped:
        run_job(options, progress=slow_batch)
    assert str(stopped.value) == f"{abandoned}; resume with: prefixcache run {spec_three_labels} {src} -o {out} --batch-size 2 --resume"
    assert stopped.value.exit_code == 130 and len(json_lines(out)) == 4


@pytest.mark.slow

def test_a_growing_files_unfinished_last_line_is_left_for_the_next_run_and_errors_are_stamped(spec_path, tmp_path):
    """An exporter mid-write (a last line with no newline, not JSON yet): the finished lines are
    scored, the unfinished one is said once and left; once written, --resume scores it. An
    error line in a cron log carries the time, as every other line does."""
    src = tmp_path / "growing.jsonl"
    rows = [json.dumps({"id": i, "text": t}) for i, t in enumerate(ticket_texts(4))]
    src.write_text("\n".join(rows[:3]) + "\n" + rows[3][:17])
    first = _sh(f"{_prefixcache()} run {spec_path} {src} -o out.jsonl --resume < /dev/null > cron.log 2>&1", tmp_path)
    log = (tmp_path / "cron.log").read_text()
    assert first.returncode == 0, log
    assert [r["id"] for r in _records(tmp_path / "out.jsonl")] == [0, 1, 2]
    assert log.count(f"{src}:4: the last line is not finished") == 1
    src.write_text("\n".join(rows) + "\n")
    again = _sh(f"{_prefixcache()} run {spec_path} {src} -o out.jsonl --resume < /dev/null >> cron.log 2>&1", tmp_path)
    assert again.returncode == 0
    assert [r["id"] for r in _records(tmp_path / "out.jsonl")] == [0, 1, 2, 3]
    src.write_text("\n".join(rows[:2]) + "\n{broken\n" + rows[3] + "\n")  # a finished line that is not JSON
    bad = _sh(f"{_prefixcache()} render {spec_path} {src} < /dev/null 2> err.log", tmp_path)  # no model: quick
    assert bad.returncode == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: error: .*:3: malformed JSON.*\n",
                        (tmp_path / "err.log").read_text().splitlines(keepends=True)[-1])


def test_fit_stopped_by_sigterm_says_what_was_kept_in_one_line(spec_path, tmp_path):
    """fit and the like stop at once on SIGTERM or Ctrl-C, with one line and exit 128 + signal."""
    from prefixcache.cli.terminal import errors, stopped_at_once

    import typer

    with pytest.raises(typer.Exit) as stopped:
        with errors(debug=False), stopped_at_once("the states read so far are kept"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted long before
    assert stopped.value.exit_code == 143
