"""A GGUF file's tokenizer is built from the file once and kept, signed, in the cache: the next
command reads it back (the same ids) instead of parsing the file again, which takes minutes for
large vocabularies; a kept copy that was changed is not used."""

from __future__ import annotations

import pytest

from gguf_fixture import write_gguf

from prefixcache.model.load import converted_dir, forget_verified, load_tokenizer, resolve_model, tokenizer_dir

pytestmark = pytest.mark.slow  # the quick tier (-m "not slow and not e2e") leaves it out

TEXTS = ["I was charged twice, please refund it.", "The app crashes when I open a project. ünïcödé"]


def test_a_gguf_files_tokenizer_is_kept_and_read_back(tmp_path, monkeypatch):
    import transformers

    source = resolve_model(str(write_gguf(tmp_path / "tiny-F32.gguf")))
    cache = tmp_path / "cache"
    first = load_tokenizer(source, cache)
    kept = tokenizer_dir(converted_dir(source, cache))
    assert kept.is_dir()
    parsed, real = [], transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: parsed.append(k.get("gguf_file")) or real(*a, **k))
    again = load_tokenizer(source, cache)
    assert parsed == [None]  # read from the kept copy, not from the GGUF file
    assert [again(t)["input_ids"] for t in TEXTS] == [first(t)["input_ids"] for t in TEXTS]
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        first.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    victim = next(p for p in kept.iterdir() if p.name.startswith("tokenizer") and p.suffix == ".json")
    victim.write_text(victim.read_text().replace("a", "b", 1))  # changed after it was signed: not used
    parsed.clear()
    forget_verified()  # as a new command starts
    load_tokenizer(source, cache)
    assert parsed == ["tiny-F32.gguf"]


def test_a_models_identity_covers_every_byte_of_its_file(tmp_path):
    """Two files of one name and size that differ only in their middle are two models (a head
    fitted on one is refused on the other); the digest is kept, so a file is read once."""
    import os

    from prefixcache.model import load

    data = os.urandom(5 << 20)
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    a.parent.mkdir(), b.parent.mkdir()
    a.write_bytes(data)
    b.write_bytes(data[: 2 << 20] + bytes(1 << 20) + data[3 << 20:])  # 1 MiB zeroed in the middle
    cache = tmp_path / "cache"
    first = load.model_content_identity(resolve_model(str(a)), cache)
    assert first != load.model_content_identity(resolve_model(str(b)), cache)
    forget_verified()  # as a new command: the digest is read from the cache, the same
    assert load.model_content_identity(resolve_model(str(a)), cache) == first
    assert len(list((cache / "checks" / "digests").iterdir())) == 2


def test_a_tokenizer_kept_without_its_config_is_replaced_only_once_its_successor_is_written(
        gguf_file, gguf_parsed, tmp_path, monkeypatch, caplog):
    """A tokenizer kept before configs were kept with it gets its config (the folder written
    again); a cache that cannot take the new folder keeps the old one."""
    from conftest import seed_cache

    from prefixcache.model import load

    source = resolve_model(str(gguf_file))
    tokenizer = load_tokenizer(source, gguf_parsed)
    for name, fails in (("written", False), ("full", True)):
        cache = seed_cache(gguf_parsed, tmp_path / name)
        converted = converted_dir(source, cache)
        kept = tokenizer_dir(converted)
        (kept / "config.json").unlink()  # as kept before configs were
        if fails:
            monkeypatch.setattr(load, "sign_folder", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
        config = load.gguf_config(source, tokenizer, converted)
        assert config is not None and config.model_type == "llama"
        assert (kept / "tokenizer.json").is_file()  # a tokenizer kept either way
        assert (kept / "config.json").is_file() is not fails
        assert ("No space left" in caplog.text) is fails
        assert not [p for p in kept.parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]  # nothing left over
