"""Hostile cases: other local users, overlapping runs, half-written exports, stops at bad moments,
files named twice, input built to break a reader. Each test failed before its fix."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from helpers import invoke, write_spec
from prefixcache.errors import Interrupted, ModelError


# -- a stop while a model or a stored prefix loads ---------------------------------------------
def test_a_stop_while_converted_weights_load_keeps_them(tmp_path, monkeypatch):
    from prefixcache.model import load

    converted = tmp_path / "models" / "abc"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    monkeypatch.setattr(load, "_usable", lambda path, source: True)

    def stopped(*args, **kwargs):
        raise Interrupted(signal.SIGINT, "interrupted by SIGINT: stopped before any record was written")

    monkeypatch.setattr(load, "_from_pretrained", stopped)
    monkeypatch.setattr(load, "_convert_gguf", lambda *a: pytest.fail("a stop must not convert again"))
    source = load.ModelSource("m.gguf", "gguf", str(tmp_path / "m.gguf"))
    with pytest.raises(Interrupted):
        load._load_gguf(source, None, converted, None)
    assert (converted / "config.json").exists()


def test_a_stop_while_a_model_loads_is_a_stop_not_a_model_error(tmp_path, monkeypatch):
    from prefixcache.model import load

    def stopped(*args, **kwargs):
        raise Interrupted(signal.SIGTERM, "interrupted by SIGTERM: stopped before any record was written")

    monkeypatch.setattr(load, "_from_pretrained", stopped)
    source = load.ModelSource("some/model", "hub", "some/model")
    with pytest.raises(Interrupted) as stop:
        load.load_model(source, None, tmp_path)
    assert not isinstance(stop.value, ModelError) and stop.value.exit_code == 143


def test_a_stop_while_a_stored_prefix_loads_keeps_it(tmp_path, monkeypatch):
    from prefixcache.model import store

    saved = tmp_path / "prefixes" / "k.safetensors"
    saved.parent.mkdir()
    saved.write_bytes(b"stored")

    def stopped(*args, **kwargs):
        raise Interrupted(signal.SIGINT, "stop")

    monkeypatch.setattr(store, "safe_open", stopped)
    with pytest.raises(Interrupted):
        store.PrefixStore(saved.parent).load("k", "cpu")
    assert saved.read_bytes() == b"stored"


# -- two processes on one output ---------------------------------------------------------------
LABELS3 = ["billing", "technical", "account"]


def _items(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": k, "text": f"ticket number {k} about a refund"}) + "\n" for k in range(n)))
    return path


@pytest.mark.parametrize("extra", [(), ("--update",), ("--resume",)])
def test_a_run_on_an_output_another_process_writes_is_refused(tmp_path, tiny_model_dir, extra):
    from prefixcache.data.lock import output_lock

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 3), tmp_path / "out.jsonl"
    if extra:
        assert invoke("run", spec, items, "-o", out, "-q").exit_code == 0
    before = out.read_bytes() if out.exists() else None
    with output_lock(str(out)):
        result = invoke("run", spec, items, "-o", out, *extra)
    assert result.exit_code == 2 and "another prefixcache process is writing it (pid" in result.output, result.output
    assert (out.read_bytes() if out.exists() else None) == before


def test_merge_into_an_output_another_process_writes_is_refused(tmp_path, tiny_model_dir):
    from prefixcache.data.lock import output_lock

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 4), tmp_path / "merged.jsonl"
    parts = [tmp_path / f"p{k}.jsonl" for k in (1, 2)]
    for k, part in enumerate(parts, 1):
        assert invoke("run", spec, items, "-o", part, "--shard", f"{k}/2", "-q", "--batch-size", "2").exit_code == 0
    with output_lock(str(out)):
        result = invoke("merge", *parts, "-o", out)
    assert result.exit_code == 2 and "another prefixcache process" in result.output, result.output
    assert not out.exists()


def test_two_processes_on_one_output_one_is_refused_the_other_completes(tmp_path, tiny_model_dir):
    import os
    import subprocess
    import sys
    import time

    from prefixcache.data.lock import lock_path

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 40), tmp_path / "out.jsonl"
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


# -- merging parts of different jobs -----------------------------------------------------------
@pytest.mark.parametrize("second, message", [
    (("--limit", "5"), "different item count (--limit)"),
    (("--keep", "text"), "different --keep"),
    (("--batch-size", "3"), "different --batch-size"),
])
def test_merge_refuses_parts_written_with_other_options(tmp_path, tiny_model_dir, second, message):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 8)
    parts = [tmp_path / "p1.csv", tmp_path / "p2.csv"]
    assert invoke("run", spec, items, "-o", parts[0], "--shard", "1/2", "-q", "--batch-size", "2").exit_code == 0
    assert invoke("run", spec, items, "-o", parts[1], "--shard", "2/2", "-q", "--batch-size", "2", *second).exit_code == 0
    result = invoke("merge", *parts, "-o", tmp_path / "merged.csv")
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "merged.csv").exists()


def test_merge_refuses_parts_that_do_not_cover_the_job(tmp_path, tiny_model_dir):
    from prefixcache.data.output import fingerprint_path

    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 8)
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


# -- what comes through a pipe ---------------------------------------------------------------
def _piped(tmp_path: Path, text: str) -> Path:
    """A FIFO that gives `text` to its first reader (a spec given as `<(cat spec.yaml)`)."""
    import os
    import threading

    fifo = tmp_path / f"fifo-{len(list(tmp_path.glob('fifo-*')))}"
    os.mkfifo(fifo)
    threading.Thread(target=fifo.write_text, args=(text,), daemon=True).start()
    return fifo


def test_a_spec_from_a_pipe_is_fingerprinted_by_its_content(tmp_path, tiny_model_dir):
    a = write_spec(tmp_path, name="a.yaml", model=str(tiny_model_dir), labels=LABELS3).read_text()
    b = write_spec(tmp_path, name="b.yaml", model=str(tiny_model_dir), labels=LABELS3, system="Another.").read_text()
    items, out = _items(tmp_path / "i.jsonl", 4), tmp_path / "out.jsonl"
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


# -- another local user and the cache ---------------------------------------------------------
OTHER_UID = 1001  # another local account (as root: chown to it, or `setpriv --reuid 1001`)
as_root = pytest.mark.skipif(__import__("os").getuid() != 0, reason="needs root to hand files to another uid")


def _chown_tree(root: Path, uid: int) -> None:
    import os

    for path in [root, *root.rglob("*")]:
        os.lchown(path, uid, uid)


def _scorer_source(spec: Path, cache: Path) -> str:
    from prefixcache.model.store import PrefixStore
    from prefixcache.scoring.prepare import Task
    from prefixcache.scoring.scorer import Scorer
    from prefixcache.task.specfile import load_spec

    task = Task.from_spec(load_spec(spec), cache)
    return Scorer.load(task, cache, "cpu", "float32", PrefixStore(cache / "prefixes")).prefix_source


@as_root
def test_another_users_prefix_store_is_never_trusted_nor_removed(tmp_path, tiny_model_dir, caplog):
    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    assert _scorer_source(spec, cache) == "computed" and _scorer_source(spec, cache) == "loaded"
    _chown_tree(cache, OTHER_UID)  # their folder, their key, a prefix signed with it
    stored = sorted(p.name for p in (cache / "prefixes").iterdir())
    assert _scorer_source(spec, cache) == "computed"
    assert f"belongs to uid {OTHER_UID}" in caplog.text
    assert sorted(p.name for p in (cache / "prefixes").iterdir()) == stored  # nothing of theirs removed
    result = invoke("run", spec, _items(tmp_path / "i.jsonl", 2), "-q", "--cache-dir", cache)
    assert result.exit_code == 0, result.output


@as_root
def test_a_store_key_another_user_owns_is_not_used(tmp_path, tiny_model_dir, caplog):
    import os

    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    _scorer_source(spec, cache)
    os.lchown(cache / "prefixes" / ".store-key", OTHER_UID, OTHER_UID)
    assert _scorer_source(spec, cache) == "computed" and ".store-key belongs to uid" in caplog.text


def _gguf():
    """The GGUF file `_converted` stands for."""
    from prefixcache.model import load

    return load.ModelSource("m.gguf", "gguf", "m.gguf")


def _converted(tmp_path: Path, chat_tokenizer) -> Path:
    """A converted model kept as prefixcache keeps one (the tiny model stands in for the GGUF's)."""
    from conftest import tiny_model
    from prefixcache.model import load
    from prefixcache.model.cache import models_dir

    target = models_dir(tmp_path / "cache") / "abc"
    load._keep_converted(tiny_model("llama", len(chat_tokenizer)), chat_tokenizer, Path("m.gguf"), target)
    return target


def test_converted_weights_changed_after_conversion_are_not_used(tmp_path, chat_tokenizer, caplog):
    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    assert load._usable(target, _gguf())
    load._TRUSTED.clear()
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # another model's numbers, the same size
    weights.write_bytes(bytes(data))
    assert not load._usable(target, _gguf())
    assert "model.safetensors is not the file converted" in caplog.text and not target.exists()


def test_converted_weights_restored_from_a_copy_are_checked_and_kept(tmp_path, chat_tokenizer):
    import shutil

    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    moved = target.with_name("moved")
    target.rename(moved)
    shutil.copytree(moved, target)  # new inodes and times, the same bytes
    assert load._usable(target, _gguf()) and target.exists()


def test_converted_weights_without_a_signature_are_converted_again(tmp_path, chat_tokenizer, caplog):
    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    (target / "prefixcache.json").write_text(json.dumps({"source": "m.gguf", "created": 0}))
    assert not load._usable(target, _gguf()) and "no signed record" in caplog.text


@as_root
def test_converted_weights_another_user_owns_are_not_used_nor_removed(tmp_path, chat_tokenizer, caplog):
    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    _chown_tree(target, OTHER_UID)
    assert not load._usable(target, _gguf()) and target.exists() and f"belongs to uid {OTHER_UID}" in caplog.text


def test_the_cache_is_private_under_any_umask(tmp_path, tiny_model_dir):
    import os

    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "fresh" / "cache"
    old = os.umask(0)
    try:
        _scorer_source(spec, cache)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in [cache.parent, *cache.parent.rglob("*")]}
    assert all(mode == (0o700 if (tmp_path / name).is_dir() else 0o600) for name, mode in modes.items()), modes


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


# -- bad input is an error with its file and line, never an internal error -------------------
def _parquet(path: Path, **columns) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_damaged_parquet_files_are_input_errors(tmp_path):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    whole = _parquet(tmp_path / "whole.parquet", id=[1, 2], text=["a", "b"]).read_bytes()
    for name, data in (("empty", b""), ("truncated", whole[: len(whole) // 2]), ("garbage", b"PAR1" + b"x" * 99 + b"PAR1")):
        (tmp_path / f"{name}.parquet").write_bytes(data)
        with pytest.raises(InputError, match=f"{name}.parquet: cannot read it as Parquet"):
            list(read_items(str(tmp_path / f"{name}.parquet")))


def test_parquet_dates_decimals_bytes_and_nan_become_json_values(tmp_path, tiny_model_dir):
    import datetime
    import decimal

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3, template="{text} on {day}")
    items = _parquet(tmp_path / "i.parquet", id=[1], text=["refund"], day=[datetime.date(2026, 12, 3)],
                     at=[datetime.datetime(2026, 12, 3, 9, 30)], amount=[decimal.Decimal("12.50")], raw=[b"\xff\x00"],
                     score=[float("nan")])
    out = tmp_path / "o.jsonl"
    result = invoke("run", spec, items, "-o", out, "--keep-all", "-q")
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert (record["day"], record["at"], record["amount"], record["raw"], record["score"]) == (
        "2026-12-03", "2026-12-03T09:30:00", "12.50", "/wA=", None)


@pytest.mark.parametrize("content, message", [
    (b'{"id": 1, "n": ' + b"9" * 5000 + b"}\n", "more than 4300 digits"),
    (b'{"id": 1, "n": NaN}\n', "NaN is not a JSON value"),
    (b'{"id": 1, "n": -Infinity}\n', "-Infinity is not a JSON value"),
])
def test_numbers_json_does_not_have_are_refused_with_the_line(tmp_path, content, message):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    (tmp_path / "i.jsonl").write_bytes(b'{"id": 0}\n' + content)
    with pytest.raises(InputError, match=f"i.jsonl:2: .*{message}"):
        list(read_items(str(tmp_path / "i.jsonl")))


@pytest.mark.parametrize("text, message", [
    ('[{"id": 1} {"id": 2}]', "expected ',' or ']' after an object, found '{'"),
    ('[{"id": 1}', "found the end of the file"),
    ('[{"id": 1}] trailing', "data after the end of the array"),
    ('[{"id": 1},]', "malformed JSON"),
])
def test_a_json_array_input_is_strict_json(tmp_path, text, message):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    (tmp_path / "i.json").write_text(text)
    with pytest.raises(InputError, match=re.escape(message)):
        list(read_items(str(tmp_path / "i.json")))


def test_a_damaged_gzip_stream_is_an_input_error(tmp_path):
    import gzip

    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    data = gzip.compress(b"".join(json.dumps({"id": k, "text": "x" * 50}).encode() + b"\n" for k in range(3000)))
    for cut in (data[: len(data) // 2], data[:100] + bytes(200) + data[300:]):
        (tmp_path / "i.jsonl.gz").write_bytes(cut)
        with pytest.raises(InputError, match="i.jsonl.gz"):
            list(read_items(str(tmp_path / "i.jsonl.gz")))


@pytest.mark.parametrize("args, message", [
    (("--format", "csv", "--encoding", "bogus"), "no such text encoding"),
    (("--format", "csv", "--delimiter", ""), "--delimiter must be one character"),
    (("--format", "csv", "--delimiter", ";;"), "--delimiter must be one character"),
    (("--device", "cuda:7"), "cuda:7"),
])
def test_bad_reading_and_device_options_are_usage_errors(tmp_path, args, message):
    spec, items = write_spec(tmp_path, labels=LABELS3), tmp_path / "i.csv"
    items.write_text("id,text\n1,refund\n")
    result = invoke("run", spec, items, *args)
    assert result.exit_code in (2, 3) and message in result.output and "internal error" not in result.output, result.output


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


# -- a full disk -----------------------------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    """A 48 KiB file system, mounted for the test (skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_full_disk_on_the_output_is_exit_2_naming_it(full_disk, tmp_path, tiny_model_dir, fmt):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 400)
    out = full_disk / f"o.{fmt}"
    result = invoke("run", spec, items, "-o", out, "-q")
    assert result.exit_code == 2 and f"{out}: cannot write the output: No space left on device" in result.output, result.output


def test_a_full_disk_under_the_cache_is_a_warning(full_disk, tmp_path, tiny_model_dir):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 2)
    (full_disk / "filler").write_bytes(bytes(40 * 1024))
    result = invoke("run", spec, items, "-o", tmp_path / "o.jsonl", "--cache-dir", full_disk / "cache")
    assert result.exit_code == 0 and "prefix store: cannot write" in result.output, result.output
    assert [p.name for p in (full_disk / "cache" / "prefixes").iterdir()] == [".store-key"]  # no temporary left


def test_a_damaged_prefix_in_a_read_only_cache_is_computed_again(tmp_path, tiny_model_dir, caplog, monkeypatch):
    import os
    import pathlib

    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    _scorer_source(spec, cache)
    [stored] = (cache / "prefixes").glob("*.safetensors")
    stored.write_bytes(stored.read_bytes()[:100])
    real = pathlib.Path.unlink

    def read_only(self, missing_ok=False):  # as a read-only file system answers (root included)
        if self == stored:
            raise PermissionError(13, "Permission denied")
        return real(self, missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    assert _scorer_source(spec, cache) == "computed" and "is unusable" in caplog.text
    assert os.path.exists(stored)


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


# -- messages that say what happened ---------------------------------------------------------
def test_an_id_met_twice_says_which_item_was_numbered(tmp_path):
    from prefixcache.data.items import scan_items
    from prefixcache.errors import InputError

    path = tmp_path / "i.jsonl"
    path.write_text('{"text": "a"}\n{"id": 1, "text": "b"}\n')
    with pytest.raises(InputError, match=r"i.jsonl:2: id 1 is given twice: the item on line 1, which has no 'id' "
                                         r"and is numbered 1 by its position"):
        scan_items(str(path), "jsonl", "id", lambda record: None)


def test_merge_into_an_existing_file_names_only_its_own_option(tmp_path):
    out = tmp_path / "merged.jsonl"
    out.write_text("x\n")
    result = invoke("merge", tmp_path / "p1.jsonl", "-o", out)
    assert result.exit_code == 2 and "use --overwrite to replace it" in result.output and "--resume" not in result.output


def test_an_empty_model_is_refused_with_the_key(tmp_path):
    spec = write_spec(tmp_path, labels=LABELS3, model="")
    result = invoke("run", spec, _items(tmp_path / "i.jsonl", 1))
    assert result.exit_code == 2 and "'model' is empty" in result.output, result.output


# -- memory stays bounded ----------------------------------------------------------------------
@pytest.mark.parametrize("command", [("render",), ("run", "--dry-run")])
def test_an_item_far_longer_than_the_context_is_refused_before_tokenising(tmp_path, tiny_model_dir, command):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "i.jsonl"
    ordinary = "".join(json.dumps({"id": k, "text": "refund"}) + "\n" for k in range(20))  # the dry run measures these
    items.write_text(ordinary + json.dumps({"id": 99, "text": "refund " * 40_000}) + "\n")  # 280 000 characters
    result = invoke(*command[:1], spec, items, *command[1:])
    assert result.exit_code == 4 and "far more than the model's context of 1024 tokens" in result.output, result.output


def test_a_huge_option_is_refused_before_tokenising(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=None, choices="options", template="Q: {text}")
    items = tmp_path / "i.jsonl"
    items.write_text(json.dumps({"id": 1, "text": "which?", "options": ["a", "b" * 100_000]}) + "\n")
    result = invoke("render", spec, items)
    assert result.exit_code == 4 and "far more than the model's context" in result.output, result.output


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_an_endless_line_is_an_error_not_unbounded_memory(tmp_path, fmt):
    from prefixcache.data.items import read_items
    from prefixcache.errors import InputError

    with pytest.raises(InputError, match="a line longer than 64 MiB"):
        next(read_items("/dev/zero", fmt))


# -- what killed writers leave behind ---------------------------------------------------------
def test_an_update_aside_left_by_kill_9_is_removed_by_the_next_run(tmp_path, tiny_model_dir):
    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 3), tmp_path / "out.jsonl"
    assert invoke("run", spec, items, "-o", out, "-q").exit_code == 0
    aside = tmp_path / ".out.jsonl.0f1e2d3c4b5a6978.part"  # as an update killed mid-write leaves it
    fingerprint_tmp = tmp_path / ".out.jsonl.prefixcache.json.a1b2c3d4e5f60718.part"
    mine = [tmp_path / ".out.jsonl.swp", tmp_path / ".out.jsonl.notes"]  # not prefixcache's: they stay
    for path in [aside, fingerprint_tmp, *mine]:
        path.write_text("x")
    assert invoke("run", spec, items, "-o", out, "--update", "-q").exit_code == 0
    assert not aside.exists() and not fingerprint_tmp.exists() and all(p.exists() for p in mine)


def test_store_temporaries_are_swept_by_a_run_that_only_loads_and_by_cache_clear(tmp_path, tiny_model_dir):
    import os
    import time

    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    _scorer_source(spec, cache)
    old, fresh = cache / "prefixes" / ".tmpab12cd34", cache / "prefixes" / ".tmp-x9y8z7w6.safetensors"
    old.write_bytes(bytes(1000))
    fresh.write_bytes(bytes(1000))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert _scorer_source(spec, cache) == "loaded"
    assert not old.exists() and fresh.exists()  # an hour old: gone; a writer may still own a fresh one
    assert invoke("cache", "clear", "--cache-dir", cache).exit_code == 0
    assert not fresh.exists()


def test_cache_clear_models_removes_only_converted_models(tmp_path, chat_tokenizer):
    target = _converted(tmp_path, chat_tokenizer)
    models = target.parent
    (models / "notes.txt").write_text("mine")
    (models / "my-model").mkdir()
    (models / "my-model" / "config.json").write_text("{}")
    (models / ".tmp-killed").mkdir()
    assert invoke("cache", "clear", "--models", "--cache-dir", tmp_path / "cache").exit_code == 0
    assert sorted(p.name for p in models.iterdir()) == ["my-model", "notes.txt"]


@as_root
def test_a_cache_folder_made_by_another_uid_is_not_used(tmp_path, tiny_model_dir):
    """The folder is made by a process of the other uid (setpriv), as a local user would plant it."""
    import os
    import shutil
    import subprocess
    import tempfile

    if not shutil.which("setpriv"):
        pytest.skip("setpriv is not installed")
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(shared, 0o777)
        planted = shared / "cache"
        made = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                               "mkdir", "-m", "777", str(planted)], capture_output=True, text=True)
        if made.returncode:
            pytest.skip(f"setpriv cannot switch uid here: {made.stderr.strip()}")
        spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3)
        result = invoke("run", spec, _items(tmp_path / "i.jsonl", 2), "-o", tmp_path / "o.jsonl", "--cache-dir", planted)
        assert result.exit_code == 0 and f"belongs to uid {OTHER_UID}" in result.output, result.output
        assert list(planted.iterdir()) == []  # nothing of ours was written into their folder
    finally:
        shutil.rmtree(shared, ignore_errors=True)
