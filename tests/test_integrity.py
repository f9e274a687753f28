"""Never a silent wrong or empty result, and no way for another local user to change one: each
case is a reproduction of a defect found by hostile testing."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port, invoke, write_spec

from prefixcache.errors import Interrupted, SpecError
from prefixcache.task.specfile import load_spec


@pytest.fixture()
def spec_path(tmp_path, tiny_model_dir):
    return write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"])


def _jsonl(path: Path, ids) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": f"ticket {i!s}"}) + "\n" for i in ids))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_fifo_given_as_a_path_is_read_once_not_as_empty(spec_path, tmp_path):
    fifo = tmp_path / "items.jsonl"
    os.mkfifo(fifo)
    data = "".join(json.dumps({"id": f"p{k}", "text": f"ticket {k}"}) + "\n" for k in range(5))
    writer = threading.Thread(target=lambda: fifo.write_text(data))
    writer.start()
    out = tmp_path / "out.jsonl"
    result = invoke("run", spec_path, fifo, "-o", out, "-q")
    writer.join()
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in _lines(out)] == [f"p{k}" for k in range(5)]


def test_merge_refuses_mixed_formats(spec_path, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [f"m{k}" for k in range(6)])
    a, b = tmp_path / "a.jsonl", tmp_path / "b.csv"
    assert invoke("run", spec_path, src, "-o", a, "--shard", "1/2", "-q").exit_code == 0
    assert invoke("run", spec_path, src, "-o", b, "--shard", "2/2", "-q").exit_code == 0
    for output in ("all.jsonl", "all.csv"):
        result = invoke("merge", a, b, "-o", tmp_path / output)
        assert result.exit_code == 2
        assert result.stderr == "error: the parts and the output must all be .jsonl or all .csv (got .csv, .jsonl)\n"
        assert not (tmp_path / output).exists()


def test_an_auto_numbered_id_and_a_written_one_are_duplicates(spec_path, tmp_path):
    numbered = tmp_path / "numbered.jsonl"
    numbered.write_text('{"text": "first"}\n{"id": "1", "text": "clash with the first one\'s number"}\n')
    assert "id '1' is given twice: the item on line 1, which has no 'id'" in invoke("run", spec_path, numbered).stderr


def test_csv_resume_keeps_records_whose_ids_hold_line_breaks(spec_path, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", ["a\rb", "c\u2028d", "plain", "e\nf"])
    out = tmp_path / "out.csv"
    assert invoke("run", spec_path, src, "-o", out, "-b", 1, "-q").exit_code == 0
    whole = out.read_bytes()
    out.write_bytes(whole[: whole.index(b"\nplain,") + 1])  # the run stopped after two records
    result = invoke("run", spec_path, src, "-o", out, "-b", 1, "--resume")
    assert result.exit_code == 0, result.output
    assert "2 items already done, 2 items in" in result.stderr
    assert out.read_bytes().count(b"\n") == whole.count(b"\n")


def test_a_planted_link_at_a_temporary_name_is_never_followed(spec_path, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.prefixcache.json.tmp").symlink_to(victim)  # the name older versions wrote to
    assert invoke("run", spec_path, _jsonl(tmp_path / "in.jsonl", ["x"]), "-o", out, "-q").exit_code == 0
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
    result = invoke("run", spec_path, _jsonl(tmp_path / "in.jsonl", ["x"]), "-o", link, "--overwrite")
    assert result.exit_code == 2
    assert result.stderr == f"error: {link}: is a symbolic link; name the file itself (prefixcache never writes through a link)\n"
    assert target.exists() != dangling and (dangling or target.read_text() == "someone else's file\n")


def test_outputs_follow_the_umask_and_the_store_is_private(spec_path, tmp_path):
    old = os.umask(0o022)
    try:
        src, out = _jsonl(tmp_path / "in.jsonl", ["a", "b"]), tmp_path / "out.jsonl"
        cache = tmp_path / "cache"
        assert invoke("run", spec_path, src, "-o", out, "-q", "--cache-dir", cache).exit_code == 0
        os.umask(0)
        _jsonl(src, ["a", "b", "c"])
        src.write_text(src.read_text().replace("ticket a", "ticket A"))  # changed: --update rewrites
        assert invoke("run", spec_path, src, "-o", out, "-q", "--update", "--cache-dir", cache).exit_code == 0
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666)  # umask 000 at the rewrite
    store = cache / "prefixes"
    assert store.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o077 == 0 for p in store.iterdir())


def test_a_cache_folder_created_under_umask_000_is_the_users_alone(spec_path, tmp_path):
    cache = tmp_path / "new" / "cache"  # neither exists: prefixcache creates both
    old = os.umask(0)
    try:
        assert invoke("run", spec_path, _jsonl(tmp_path / "in.jsonl", ["a"]), "-q", "--cache-dir", cache).exit_code == 0
    finally:
        os.umask(old)
    for folder in (tmp_path / "new", cache, cache / "prefixes"):
        assert oct(folder.stat().st_mode & 0o777) == oct(0o700), folder
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o600) for p in (cache / "prefixes").iterdir() if p.is_file())


def test_a_stored_prefix_rewritten_to_another_key_is_rebuilt(tmp_path, chat_tokenizer, caplog):
    from conftest import tiny_model
    from helpers import make_spec
    from safetensors import safe_open
    from safetensors.torch import save_file

    from prefixcache.model.engine import Engine
    from prefixcache.task.prompt import PromptBuilder
    from prefixcache.model.store import PrefixStore

    engine = Engine(tiny_model("llama", len(chat_tokenizer)))
    one = engine.prefill(PromptBuilder(make_spec(tmp_path, system="One task."), chat_tokenizer).prefix_ids)
    store = PrefixStore(tmp_path / "store")
    store.save("key-one", one, "tiny")
    with safe_open(str(tmp_path / "store" / "key-one.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(tmp_path / "store" / "key-two.safetensors"), metadata={**meta, "key": "key-two"})
    assert store.load("key-two", "cpu") is None  # the header claims another key: not signed for it
    assert "not signed by this store" in caplog.text
    assert store.load("key-one", "cpu") is not None


def test_stale_temporary_files_are_cleaned(tmp_path, chat_tokenizer):
    from conftest import tiny_model
    from helpers import make_spec

    from prefixcache.model.engine import Engine
    from prefixcache.task.prompt import PromptBuilder
    from prefixcache.model.store import PrefixStore

    store_dir = tmp_path / "store"
    store_dir.mkdir()
    old, fresh = store_dir / ".tmp-abc.safetensors", store_dir / ".tmp-def.safetensors"
    old.write_bytes(b"x" * 1000)
    fresh.write_bytes(b"y")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    engine = Engine(tiny_model("llama", len(chat_tokenizer)))
    PrefixStore(store_dir).save("k", engine.prefill(PromptBuilder(make_spec(tmp_path), chat_tokenizer).prefix_ids), "t")
    assert not old.exists() and fresh.exists()  # a writer may still own the fresh one


@pytest.mark.parametrize("text,message", [
    ("labels: &a [x, y]\nexamples: [{text: *a, label: x}]\n", "YAML alias *a is not allowed in a spec; write the value out"),
    ("labels: [a, b]\nlabels: [c, d]\n", "key 'labels' is given twice"),
    ("labels: [yes, no]\n", "label True is how YAML reads an unquoted yes/no/true/false/on/off; quote the label, e.g. \"yes\""),
])
def test_spec_yaml_traps(tmp_path, text, message):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as refused:
        load_spec(path)
    assert str(refused.value).endswith(message)


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


def test_usage_errors_and_report_paths_are_one_line_before_the_run(spec_path, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", ["x"])
    zero = invoke("run", spec_path, src, "--limit", 0)
    assert zero.exit_code == 2
    assert zero.stderr == ("error: Invalid value for '--limit' / '-n': Input should be greater than or equal to 1 "
                           "(see prefixcache run -h)\n")
    gold = write_spec(tmp_path, name="gold.yaml", model=load_spec(spec_path).model, labels=["tech", "billing"], gold="answer")
    src.write_text('{"id": 1, "text": "x", "answer": "tech"}\n')
    missing = invoke("run", gold, src, "-o", tmp_path / "o.jsonl", "--metrics", tmp_path / "no" / "m.json")
    assert missing.exit_code == 2
    assert missing.stderr == f"error: --metrics {tmp_path / 'no' / 'm.json'}: folder {tmp_path / 'no'} does not exist\n"
    assert not (tmp_path / "o.jsonl").exists()


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
    assert grown.exit_code == 0 and [r["id"] for r in _lines(out)] == [f"s{k}" for k in range(5)]
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


@pytest.mark.slow
def test_world_size_without_a_launcher_fails_in_bounded_time(spec_path, tmp_path):
    import subprocess
    import sys

    src = _jsonl(tmp_path / "in.jsonl", ["x"])
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    no_master = subprocess.run([sys.executable, "-m", "prefixcache", "run", str(spec_path), str(src), "-q"],
                               env={**base, "WORLD_SIZE": "2"}, capture_output=True, text=True, timeout=120)
    assert no_master.returncode == 2 and no_master.stderr.endswith(
        "error: WORLD_SIZE is 2 but no launcher started this process (MASTER_ADDR is not set); use accelerate "
        "launch or torchrun, or unset WORLD_SIZE to run one process\n")
    code = "import prefixcache.run.shards as s; s.LAUNCH_TIMEOUT = 3\nfrom prefixcache.cli import main\nmain()"
    env = {**base, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    started = time.monotonic()
    alone = subprocess.run([sys.executable, "-c", code, "run", str(spec_path), str(src), "-q"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and time.monotonic() - started < 60
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
