"""Output safety: every file the program writes goes through one safe writer, and what another
local user plants where a run writes (a link, a FIFO, a file of theirs, a folder they can change
above the cache) is refused or left alone, never followed."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import invoke, write_records, write_spec

PACKAGE = Path(__file__).resolve().parent.parent / "prefixcache"
LABELS3 = ["billing", "technical", "account"]
OTHER_UID = 1001
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand files to another uid")


def _items(path: Path, n: int, **extra) -> Path:
    path.write_text("".join(json.dumps({"id": k, "text": f"ticket {k} about a refund", **extra}) + "\n"
                            for k in range(n)))
    return path


def _theirs(path: Path, text: str) -> Path:
    """A file another user wrote (as root: handed to their uid)."""
    path.write_text(text)
    os.lchown(path, OTHER_UID, OTHER_UID)
    return path


def _two_shards(spec: Path, items: Path, tmp_path: Path) -> list[Path]:
    """The two parts of `run --shard K/2`."""
    parts = [tmp_path / f"p{k}.jsonl" for k in (1, 2)]
    for k, part in enumerate(parts, 1):
        assert invoke("run", spec, items, "-o", part, "--shard", f"{k}/2", "-q").exit_code == 0
    return parts


@pytest.fixture()
def job(tmp_path, tiny_model_dir):
    """A spec on the tiny model, three items with gold, the output's path."""
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3, gold="label")
    return spec, _items(tmp_path / "i.jsonl", 3, label="billing"), tmp_path / "out.jsonl"


# -- the one writer --------------------------------------------------------------------------
WRITES = re.compile(r"O_WRONLY|O_RDWR|O_CREAT|O_APPEND|O_TRUNC")
# Writers outside safefile.py, each with why it is safe.
ALLOWED = {
    ("cli/terminal.py", "os.open"): "opens /dev/null, to point a closed stdout at",
    ("model/load.py", "save_pretrained"): "writes into a new 0700 folder made by mkdtemp, renamed into place",
    ("model/load.py", "mkdtemp"): "the conversion's own new 0700 folder, made exclusively",
    ("model/load.py", "tmp.rename"): "renames that folder into place (a rename never follows a link)",
}


def _writers(path: Path) -> list[tuple[str, int]]:
    """Each call in `path` that opens a file for writing, by name, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        last = name.rsplit(".", 1)[-1]
        args = " ".join(ast.unparse(a) for a in [*node.args, *(k.value for k in node.keywords)])
        if last == "open" and "." not in name or name in ("io.open", "os.fdopen", "gzip.open"):
            modes = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            modes += [k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
            if any(set(str(m)) & set("wax+") for m in modes):
                found.append((name, node.lineno))
        elif name == "os.open" and WRITES.search(args):
            found.append((name, node.lineno))
        elif name.startswith("shutil.copy") or name in ("os.link", "os.symlink"):
            found.append((name, node.lineno))
        elif last in ("write_text", "write_bytes", "mkstemp", "mkdtemp", "NamedTemporaryFile", "save_file",
                      "save_pretrained", "replace", "rename"):
            if last in ("replace", "rename") and not name.startswith(("os.", "shutil.")) and "path" not in name.lower():
                if not name.endswith(("tmp.rename", "temp.rename")):
                    continue  # str.replace and friends
            found.append((name, node.lineno))
    return found


def test_the_safe_writer_is_the_only_place_that_opens_a_file_for_writing():
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where == "safefile.py":
            continue
        for name, line in _writers(path):
            if (where, name.rsplit(".", 1)[-1]) not in ALLOWED and (where, name) not in ALLOWED:
                stray.append(f"{where}:{line}: {name}")
    assert not stray, "files written outside safefile.py:\n" + "\n".join(stray)


def test_the_writer_check_finds_a_write(tmp_path, monkeypatch):
    """The check above can fail: each way of writing a file is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nopen(p, 'w')\nos.open(p, os.O_WRONLY | os.O_CREAT)\nPath(p).write_text('x')\n"
                   "tmp.rename(p)\nopen(p, mode='a')\nopen(p)\n'x'.replace('a', 'b')\n")
    assert [line for _, line in _writers(bad)] == [2, 3, 4, 5, 6]


def test_replacing_leaves_the_target_as_it_was_when_writing_fails(tmp_path):
    from prefixcache import safefile

    target = tmp_path / "report.json"
    target.write_text("before")
    with pytest.raises(RuntimeError):
        with safefile.replacing(target, text=True) as f:
            f.write("half")
            raise RuntimeError("the disk went away")
    assert target.read_text() == "before" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_link_planted_as_the_target_is_refused_never_followed(tmp_path):
    from prefixcache import safefile
    from prefixcache.errors import OutputError

    victim = tmp_path / "victim"
    victim.write_text("theirs")
    link = tmp_path / "report.json"
    link.symlink_to(victim)
    for write in (lambda: safefile.replace(link, "x"), lambda: safefile.append(link).close(),
                  lambda: safefile.create(link).close(), lambda: safefile.check_target(link)):
        with pytest.raises(OutputError, match="symbolic link"):
            write()
    assert victim.read_text() == "theirs" and link.is_symlink()


# -- the output's lock --------------------------------------------------------------------------
@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_planted_as_the_lock_is_refused(job, tmp_path, dangling):
    spec, items, out = job
    victim = tmp_path / "root-only" / "file" if dangling else tmp_path / "victim.txt"
    if not dangling:
        victim.write_text("precious\n")
    (tmp_path / ".out.jsonl.lock").symlink_to(victim)
    result = invoke("run", spec, items, "-o", out)
    assert result.exit_code == 2 and "symbolic link" in result.output, result.output
    assert victim.read_text() == "precious\n" if not dangling else not victim.exists()
    assert (tmp_path / ".out.jsonl.lock").is_symlink() and not out.exists()


def test_a_fifo_planted_as_the_lock_is_refused_without_blocking(job, tmp_path):
    spec, items, out = job
    os.mkfifo(tmp_path / ".out.jsonl.lock")
    result = invoke("run", spec, items, "-o", out)
    assert result.exit_code == 2 and "is a FIFO, not a regular file" in result.output, result.output


def test_a_link_planted_as_the_merged_outputs_lock_is_refused(job, tmp_path):
    spec, items, _ = job
    parts = _two_shards(spec, items, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / ".merged.jsonl.lock").symlink_to(victim)
    result = invoke("merge", *parts, "-o", tmp_path / "merged.jsonl")
    assert result.exit_code == 2 and "symbolic link" in result.output and victim.read_text() == "precious\n"


@as_root
def test_a_lock_file_of_another_user_is_refused_and_its_bytes_never_reach_the_terminal(job, tmp_path):
    spec, items, out = job
    _theirs(tmp_path / ".out.jsonl.lock", "\x1b[2J\x1b[31mSECURITY: run rm -rf\n")
    result = invoke("run", spec, items, "-o", out)
    assert result.exit_code == 2 and f"belongs to another user (uid {OTHER_UID})" in result.output
    assert "\x1b" not in result.output and "SECURITY" not in result.output


def test_what_a_lock_holder_wrote_is_shown_with_its_control_characters_escaped(job, tmp_path):
    import fcntl

    spec, items, out = job
    lock = tmp_path / ".out.jsonl.lock"
    lock.write_text("pid 1 \x1b[2J\x1b[31mSECURITY\n")
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = invoke("run", spec, items, "-o", out)
    assert result.exit_code == 2 and "another prefixcache process" in result.output
    assert "\x1b" not in result.output and "\\x1b[2J" in result.output


def test_a_full_disk_when_the_lock_is_written_is_exit_2_naming_the_output(job, monkeypatch):
    import errno

    from prefixcache.data import lock

    spec, items, out = job

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock.os, "write", full)
    result = invoke("run", spec, items, "-o", out)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {out}: cannot write its lock file") and "No space left" in result.output


# -- report files ---------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--metrics", "--junit", "--summary-md"])
def test_a_report_file_planted_as_a_link_is_refused_before_the_run(job, tmp_path, option):
    spec, items, out = job
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "report").symlink_to(victim)
    result = invoke("run", spec, items, "-o", out, option, tmp_path / "report")
    assert result.exit_code == 2 and f"{option} {tmp_path / 'report'}: is a symbolic link" in result.output
    assert victim.read_text() == "precious\n" and not out.exists()


@pytest.mark.parametrize("name", ["out.jsonl.prefixcache.json", ".out.jsonl.lock"])
def test_a_report_may_not_be_one_of_the_runs_own_files(job, tmp_path, name):
    spec, items, out = job
    assert invoke("run", spec, items, "-o", out, "-q").exit_code == 0
    fingerprint = (tmp_path / "out.jsonl.prefixcache.json").read_bytes()
    result = invoke("run", spec, items, "-o", out, "--overwrite", "--metrics", tmp_path / name)
    assert result.exit_code == 2 and "write it to another file" in result.output, result.output
    assert (tmp_path / "out.jsonl.prefixcache.json").read_bytes() == fingerprint


@as_root
def test_a_summary_of_another_user_is_not_appended_to(job, tmp_path):
    spec, items, out = job
    summary = _theirs(tmp_path / "summary.md", "theirs\n")
    result = invoke("run", spec, items, "-o", out, "--summary-md", summary)
    assert result.exit_code == 2 and f"belongs to another user (uid {OTHER_UID})" in result.output, result.output
    assert summary.read_text() == "theirs\n"


def test_report_and_diff_files_planted_as_links_are_refused(tmp_path):
    from helpers import A, B

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_records(a, A)
    write_records(b, B)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "link").symlink_to(victim)
    for args in (("report", a, "-o", tmp_path / "link", "--overwrite"), ("diff", a, b, "--json", tmp_path / "link"),
                 ("diff", a, b, "--md", tmp_path / "link")):
        result = invoke(*args)
        assert result.exit_code == 2 and "symbolic link" in result.output, (args, result.output)
    assert victim.read_text() == "precious\n"


def test_diff_shows_ids_with_their_control_characters_escaped(tmp_path):
    from helpers import hand_record

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_records(a, [hand_record("x\x1b[2Jy", "billing", {"billing": 0.9, "account": 0.1})])
    write_records(b, [hand_record("x\x1b[2Jy", "account", {"billing": 0.2, "account": 0.8})])
    result = invoke("diff", a, b)
    assert result.exit_code == 0 and "\x1b" not in result.output and "\\x1b[2Jy" in result.output, result.output


# -- merge ----------------------------------------------------------------------------------
def test_merge_refuses_an_output_that_is_one_of_its_parts(job, tmp_path):
    spec, items, _ = job
    parts = _two_shards(spec, items, tmp_path)
    before = parts[0].read_bytes()
    result = invoke("merge", *parts, "-o", parts[0], "--overwrite")
    assert result.exit_code == 2 and "write it to another file" in result.output, result.output
    assert parts[0].read_bytes() == before


# -- the cache ------------------------------------------------------------------------------
def _prefix_source(spec: Path, cache: Path) -> str:
    from prefixcache.model.store import PrefixStore
    from prefixcache.scoring.prepare import Task
    from prefixcache.scoring.scorer import Scorer
    from prefixcache.task.specfile import load_spec

    task = Task.from_spec(load_spec(spec), cache)
    return Scorer.load(task, cache, "cpu", "float32", PrefixStore(cache / "prefixes")).prefix_source


def test_a_cache_under_a_folder_others_can_change_is_not_trusted(tmp_path, tiny_model_dir, caplog):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3)
    pub = tmp_path / "pub"
    pub.mkdir(mode=0o700)
    cache = pub / "pc"
    assert _prefix_source(spec, cache) == "computed" and _prefix_source(spec, cache) == "loaded"
    os.chmod(pub, 0o777)  # now anyone may swap pub/pc for a twin of theirs
    assert _prefix_source(spec, cache) == "computed"
    assert f"{pub} may be changed by other users (mode 777)" in caplog.text
    os.chmod(pub, 0o1777)  # sticky, like /tmp: no one else may rename what is ours
    assert _prefix_source(spec, cache) == "loaded"


def _converted(cache: Path, chat_tokenizer, source: str, name: str) -> Path:
    from conftest import tiny_model
    from prefixcache.model import load
    from prefixcache.model.cache import models_dir

    target = models_dir(cache) / name
    load.private_folder(target.parent)
    load.keep_converted(tiny_model("llama", len(chat_tokenizer)), chat_tokenizer, Path(source), target)
    return target


def test_converted_folders_swapped_into_each_others_place_are_not_used(tmp_path, chat_tokenizer, caplog):
    from prefixcache.model import load

    cache = tmp_path / "cache"
    a = _converted(cache, chat_tokenizer, str(tmp_path / "a.gguf"), "aaa")
    b = _converted(cache, chat_tokenizer, str(tmp_path / "b.gguf"), "bbb")
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    source_b = load.ModelSource("b.gguf", "gguf", str(tmp_path / "b.gguf"))
    assert not load.converted_usable(b, source_b)
    assert f"it was converted from {tmp_path / 'a.gguf'}, not from {tmp_path / 'b.gguf'}" in caplog.text


def test_cache_clear_removes_only_what_it_made(tmp_path, tiny_model_dir, chat_tokenizer):
    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    _prefix_source(spec, cache)
    ours = _converted(cache, chat_tokenizer, str(tmp_path / "m.gguf"), "ours")
    theirs = cache / "models" / "notes"
    theirs.mkdir()
    (theirs / "prefixcache.json").write_text("{}")
    foreign_prefix = cache / "prefixes" / "mine.safetensors"
    foreign_prefix.write_bytes(b"not a prefix of prefixcache's")
    stored = [p for p in (cache / "prefixes").glob("*.safetensors") if p != foreign_prefix]
    assert stored
    result = invoke("cache", "clear", "--models", "--cache-dir", cache)
    assert result.exit_code == 0, result.output
    assert not ours.exists() and not any(p.exists() for p in stored)
    assert (theirs / "prefixcache.json").exists() and foreign_prefix.exists()


def test_a_read_only_stored_prefix_is_used_with_a_warning(tmp_path, tiny_model_dir, monkeypatch, caplog):
    import errno

    from prefixcache.model import store

    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    assert _prefix_source(spec, cache) == "computed"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(store.os, "utime", read_only)
    assert _prefix_source(spec, cache) == "loaded"
    assert "cannot mark" in caplog.text and "Read-only file system" in caplog.text


@as_root
def test_a_converted_folder_under_a_folder_another_user_swaps_is_never_loaded(tmp_path, tiny_model_dir):
    """A second uid swaps the cache for a forged twin while runs go on: no run scores with it."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv is not installed")
    import tempfile

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3)
    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # a folder the other uid can reach
    try:
        os.chmod(shared, 0o755)
        pub = shared / "pub"
        pub.mkdir()
        cache = pub / "pc"
        assert _prefix_source(spec, cache) == "computed"
        os.chmod(pub, 0o777)
        swap = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                               "mv", str(cache), str(pub / "theirs")], capture_output=True, text=True)
        if swap.returncode:
            pytest.skip(f"setpriv cannot switch uid here: {swap.stderr.strip()}")
        (pub / "theirs").rename(cache)  # it could be their twin now
        assert _prefix_source(spec, cache) == "computed"
    finally:
        shutil.rmtree(shared)


# -- an input rewritten while the run reads it --------------------------------------------------
@pytest.mark.parametrize("rewrite, message", [
    (lambda lines: lines[:2], "the check before the run found 6 items, the run read 2 (the last was item 1)"),
    (lambda lines: [lines[0].replace("refund", "crash"), *lines[1:]], "its items are not the ones the check"),
])
def test_an_input_rewritten_under_the_run_is_not_exit_0_and_update_finishes_it(tmp_path, tiny_model_dir,
                                                                               monkeypatch, rewrite, message):
    from prefixcache.run import job as job_module

    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "i.jsonl", tmp_path / "o.jsonl"
    whole = _items(items, 6).read_text()
    loading = job_module.load_scorer

    def regenerated(*args):  # the export is written again in place after the check, as the run starts
        items.write_text("".join(rewrite(whole.splitlines(keepends=True))))
        return loading(*args)

    monkeypatch.setattr(job_module, "load_scorer", regenerated)
    result = invoke("run", spec, items, "-o", out, "-q")
    assert result.exit_code == 2 and f"{items}: changed while it was read" in result.output, result.output
    assert message in result.output and "--update" in result.output
    monkeypatch.undo()
    items.write_text(whole)
    assert invoke("run", spec, items, "-o", out, "--update", "-q").exit_code == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(6))


def test_resuming_with_another_pruning_mode_is_refused(tmp_path, tiny_model_dir):
    spec, items, out = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), _items(tmp_path / "i.jsonl", 6), tmp_path / "o.jsonl"
    assert invoke("run", spec, items, "-o", out, "--limit", "3", "-q").exit_code == 0  # auto: 3 labels, not pruned
    before = out.read_bytes()
    result = invoke("run", spec, items, "-o", out, "--resume", "--prune", "on")
    assert result.exit_code == 2 and "it was written with --prune off" in result.output, result.output
    assert out.read_bytes() == before


def test_no_cache_is_made_under_a_folder_others_can_change(tmp_path, tiny_model_dir, caplog):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3)
    pub = tmp_path / "pub"
    pub.mkdir()
    os.chmod(pub, 0o777)
    assert _prefix_source(spec, pub / "pc") == "computed"
    assert not (pub / "pc").exists() and "may be changed by other users" in caplog.text
