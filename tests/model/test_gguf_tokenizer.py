"""A GGUF file's tokenizer is built from the file once and kept, signed, in the cache: the next
command reads it back (the same ids) instead of parsing the file again, which takes minutes for
large vocabularies; a kept copy that was changed is not used."""

from __future__ import annotations

from gguf_fixture import write_gguf

from prefixcache.model.load import converted_dir, forget_verified, load_tokenizer, resolve_model, tokenizer_dir

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
