"""The cache is the user's alone: folders, converted weights and stored prefixes another user
owns, changed, swapped or planted are never trusted; damaged ones are rebuilt; a cache that
cannot be written is a warning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
import pytest
from helpers import invoke, write_spec
from prefixcache.task.specfile import load_spec
from prefixcache.errors import Interrupted
import time
from helpers import LABELS3, items_file, jsonl_of_ids, refund_items_file


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

    task = Task.from_spec(load_spec(spec), cache)
    return Scorer.load(task, cache, "cpu", "float32", PrefixStore(cache / "prefixes")).prefix_source


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
    load.keep_converted(tiny_model("llama", len(chat_tokenizer)), chat_tokenizer, Path("m.gguf"), target)
    return target


@pytest.mark.parametrize("value", ["abc", "inf", "nan", "-5"])
def test_bad_store_size_in_the_environment(spec_path, tmp_path, value):
    result = invoke("run", spec_path, items_file(tmp_path), env={"PREFIXCACHE_STORE_MAX_MB": value})
    assert result.exit_code == 2
    assert result.stderr == f"error: PREFIXCACHE_STORE_MAX_MB must be a number of megabytes (0 or more), not {value!r}\n"


def test_an_unwritable_cache_folder_is_a_warning(spec_path, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    result = invoke("run", spec_path, items_file(tmp_path), "--cache-dir", blocked, "-o", tmp_path / "o.jsonl")
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


# -- a stop while a model or a stored prefix loads ---------------------------------------------
def test_a_stop_while_converted_weights_load_keeps_them(tmp_path, monkeypatch):
    from prefixcache.model import load

    converted = tmp_path / "models" / "abc"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    monkeypatch.setattr(load, "converted_usable", lambda path, source: True)

    def stopped(*args, **kwargs):
        raise Interrupted(signal.SIGINT, "interrupted by SIGINT: stopped before any record was written")

    monkeypatch.setattr(load, "load_weights", stopped)
    monkeypatch.setattr(load, "_convert_gguf", lambda *a: pytest.fail("a stop must not convert again"))
    source = load.ModelSource("m.gguf", "gguf", str(tmp_path / "m.gguf"))
    with pytest.raises(Interrupted):
        load.load_gguf(source, None, converted, None)
    assert (converted / "config.json").exists()


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


@as_root
def test_another_users_prefix_store_is_never_trusted_nor_removed(tmp_path, tiny_model_dir, caplog):
    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    assert _scorer_source(spec, cache) == "computed" and _scorer_source(spec, cache) == "loaded"
    _chown_tree(cache, OTHER_UID)  # their folder, their key, a prefix signed with it
    stored = sorted(p.name for p in (cache / "prefixes").iterdir())
    assert _scorer_source(spec, cache) == "computed"
    assert f"belongs to uid {OTHER_UID}" in caplog.text
    assert sorted(p.name for p in (cache / "prefixes").iterdir()) == stored  # nothing of theirs removed
    result = invoke("run", spec, refund_items_file(tmp_path / "i.jsonl", 2), "-q", "--cache-dir", cache)
    assert result.exit_code == 0, result.output


@as_root
def test_a_store_key_another_user_owns_is_not_used(tmp_path, tiny_model_dir, caplog):
    import os

    spec, cache = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), tmp_path / "cache"
    _scorer_source(spec, cache)
    os.lchown(cache / "prefixes" / ".store-key", OTHER_UID, OTHER_UID)
    assert _scorer_source(spec, cache) == "computed" and ".store-key belongs to uid" in caplog.text


def test_converted_weights_changed_after_conversion_are_not_used(tmp_path, chat_tokenizer, caplog):
    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    assert load.converted_usable(target, _gguf())
    load.forget_verified()  # as a new process would
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # another model's numbers, the same size
    weights.write_bytes(bytes(data))
    assert not load.converted_usable(target, _gguf())
    assert "model.safetensors is not the file converted" in caplog.text and not target.exists()


def test_converted_weights_restored_from_a_copy_are_checked_and_kept(tmp_path, chat_tokenizer):
    import shutil

    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    moved = target.with_name("moved")
    target.rename(moved)
    shutil.copytree(moved, target)  # new inodes and times, the same bytes
    assert load.converted_usable(target, _gguf()) and target.exists()


def test_converted_weights_without_a_signature_are_converted_again(tmp_path, chat_tokenizer, caplog):
    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    (target / "prefixcache.json").write_text(json.dumps({"source": "m.gguf", "created": 0}))
    assert not load.converted_usable(target, _gguf()) and "no signed record" in caplog.text


@as_root
def test_converted_weights_another_user_owns_are_not_used_nor_removed(tmp_path, chat_tokenizer, caplog):
    from prefixcache.model import load

    target = _converted(tmp_path, chat_tokenizer)
    _chown_tree(target, OTHER_UID)
    assert not load.converted_usable(target, _gguf()) and target.exists() and f"belongs to uid {OTHER_UID}" in caplog.text


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


def test_a_full_disk_under_the_cache_is_a_warning(full_disk, tmp_path, tiny_model_dir):
    spec, items = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3), refund_items_file(tmp_path / "i.jsonl", 2)
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
        result = invoke("run", spec, refund_items_file(tmp_path / "i.jsonl", 2), "-o", tmp_path / "o.jsonl", "--cache-dir", planted)
        assert result.exit_code == 0 and f"belongs to uid {OTHER_UID}" in result.output, result.output
        assert list(planted.iterdir()) == []  # nothing of ours was written into their folder
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_outputs_follow_the_umask_and_the_store_is_private(spec_path, tmp_path):
    old = os.umask(0o022)
    try:
        src, out = jsonl_of_ids(tmp_path / "in.jsonl", ["a", "b"]), tmp_path / "out.jsonl"
        cache = tmp_path / "cache"
        assert invoke("run", spec_path, src, "-o", out, "-q", "--cache-dir", cache).exit_code == 0
        os.umask(0)
        jsonl_of_ids(src, ["a", "b", "c"])
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
        assert invoke("run", spec_path, jsonl_of_ids(tmp_path / "in.jsonl", ["a"]), "-q", "--cache-dir", cache).exit_code == 0
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
    store.save("key-one", one, "tiny", engine)
    with safe_open(str(tmp_path / "store" / "key-one.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(tmp_path / "store" / "key-two.safetensors"), metadata={**meta, "key": "key-two"})
    assert store.load("key-two", engine) is None  # the header claims another key: not signed for it
    assert "not signed by this store" in caplog.text
    assert store.load("key-one", engine) is not None


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
    PrefixStore(store_dir).save("k", engine.prefill(PromptBuilder(make_spec(tmp_path), chat_tokenizer).prefix_ids), "t", engine)
    assert not old.exists() and fresh.exists()  # a writer may still own the fresh one

