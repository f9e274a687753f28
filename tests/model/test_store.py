"""The prefix store: hits, misses on every fingerprint component, corruption, concurrent writers,
eviction, and the CLI around it."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import tiny_model
from helpers import invoke, make_spec, records, write_spec

from prefixcache.model.engine import Engine
from prefixcache.task.prompt import PromptBuilder
from prefixcache.model.store import PrefixStore, prefix_key


@pytest.fixture()
def prefilled(chat_tokenizer, tmp_path):
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    engine = Engine(tiny_model("llama", len(chat_tokenizer)))
    return engine, engine.prefill(builder.prefix_ids)


def _same(a, b) -> bool:
    return a.ids == b.ids and torch.equal(a.last_logits, b.last_logits) and all(
        torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(a.kv, b.kv, strict=True))


def test_hit_returns_the_same_tensors(prefilled, tmp_path):
    engine, prefix = prefilled
    store = PrefixStore(tmp_path / "store")
    assert store.load("k", engine) is None
    store.save("k", prefix, "tiny", engine)
    loaded = store.load("k", engine)
    assert _same(loaded, prefix)
    [entry] = store.entries()
    assert (entry.key, entry.model, entry.prefix_tokens) == ("k", "tiny", len(prefix.ids))


def test_every_fingerprint_component_changes_the_key(monkeypatch):
    base = dict(model_identity="dir:m:1", engine="transformers", version="5.0", dtype=torch.float32,
                device_type="cpu", prefix_ids=[1, 2, 3])
    key = prefix_key(**base)
    assert key == prefix_key(**base)
    for change in (dict(model_identity="dir:m:2"), dict(engine="llama.cpp"), dict(version="5.1"),
                   dict(dtype=torch.bfloat16), dict(device_type="cuda"), dict(prefix_ids=[1, 2, 4])):
        assert prefix_key(**{**base, **change}) != key
    monkeypatch.setattr(torch, "__version__", "0.0-other")
    assert prefix_key(**base) != key
    monkeypatch.undo()
    import transformers  # the module as it is now: loading a model class replaces transformers' lazy module

    monkeypatch.setattr(transformers, "__version__", "0.0-other")
    assert prefix_key(**base) != key


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_file_is_reported_and_rebuilt(prefilled, tmp_path, caplog, damage):
    engine, prefix = prefilled
    store = PrefixStore(tmp_path)
    store.save("k", prefix, "tiny", engine)
    path = tmp_path / "k.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF  # a bit in the last tensor's bytes
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        store.save("other", prefix, "tiny", engine)
        data = bytearray((tmp_path / "other.safetensors").read_bytes())  # a valid file under the wrong name
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="prefixcache"):
        assert store.load("k", engine) is None
    assert "is unusable" in caplog.text and not path.exists()
    store.save("k", prefix, "tiny", engine)
    assert _same(store.load("k", engine), prefix)


def test_concurrent_writers_leave_one_good_file(prefilled, tmp_path):
    engine, prefix = prefilled
    store = PrefixStore(tmp_path / "store")
    threads = [threading.Thread(target=store.save, args=("k", prefix, "tiny", engine)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [".store-key", "k.safetensors"]  # no temporary files left
    assert _same(store.load("k", engine), prefix)


def test_least_recently_used_are_evicted(prefilled, tmp_path):
    import os
    import time

    engine, prefix = prefilled
    store = PrefixStore(tmp_path)
    store.save("a", prefix, "tiny", engine)
    size = (tmp_path / "a.safetensors").stat().st_size
    store.max_bytes = int(2.5 * size)
    store.save("b", prefix, "tiny", engine)
    old = time.time() - 100
    os.utime(tmp_path / "a.safetensors", (old, old))
    os.utime(tmp_path / "b.safetensors", (old + 1, old + 1))
    assert store.load("a", engine) is not None  # a hit makes "a" the most recently used
    store.save("c", prefix, "tiny", engine)
    assert sorted(e.key for e in store.entries()) == ["a", "c"]




def test_cli_second_run_loads_the_prefix_and_writes_the_same_records(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"id": i, "text": f"ticket {i} crashed"}) + "\n" for i in range(5)))
    store_dir = tmp_path / "cache"
    outs = []
    for n, extra in enumerate(([], [], ["--no-cache-store"])):
        out = tmp_path / f"o{n}.jsonl"
        result = invoke("run", str(spec), str(items), "-o", str(out), "--cache-dir", str(store_dir), *extra)
        assert result.exit_code == 0, result.output
        assert ("loaded in" if n == 1 else "computed in") in result.stderr
        outs.append(records(out))
    assert outs[0] == outs[1] == outs[2]
    listed = invoke("cache", "list", "--cache-dir", str(store_dir), "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["kind"] for r in rows] == ["prefix"] and rows[0]["prefix_tokens"] > 0
    from prefixcache.scoring.bounds import BoundStore

    BoundStore(store_dir).put("k" * 32, 0.1, 32, 0.05)  # what --exact measured: derived, cleared with the rest
    assert BoundStore(store_dir).get("k" * 32) == 0.1
    cleared = invoke("cache", "clear", "--cache-dir", str(store_dir))
    assert cleared.exit_code == 0 and "removed 1 stored prefixes" in cleared.stderr
    assert invoke("cache", "list", "--cache-dir", str(store_dir), "--json").stdout == ""
    assert BoundStore(store_dir).get("k" * 32) is None
