"""A GGUF file's header is walked within bounds before anything parses it: a file whose
metadata would take gguf's reader gigabytes and minutes (a 20,000,000-entry array), or whose
counts and lengths run past its end, is refused in one line at once; real files pass."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from gguf_fixture import write_gguf

from prefixcache.errors import ModelError
from prefixcache.model.ggufheader import MAX_ARRAY, check_gguf
from prefixcache.model.load import embedded_model_file

UINT32, STRING, ARRAY = 4, 8, 9


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _header(keys: list[bytes], tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, len(keys)) + b"".join(keys)


def _array(key: str, kind: int, count: int, payload: bytes = b"") -> bytes:
    return _string(key) + struct.pack("<IIQ", ARRAY, kind, count) + payload


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name, data, why", [
    ("huge-array", _header([_array("general.junk", UINT32, 20_000_000, bytes(80_000_000))]), "holds 20,000,000 entries"),
    ("huge-string-array", _header([_array("tokenizer.ggml.tokens", STRING, MAX_ARRAY + 1)]), "holds 2,097,153 entries"),
    ("count-past-end", _header([_array("general.junk", UINT32, 1000, bytes(40))]), "runs past the end"),
    ("long-string", _header([_string("general.name") + struct.pack("<IQ", STRING, 1 << 40)]), "bytes long"),
    ("many-keys", b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40), "metadata keys"),
    ("not-gguf", b"PK\x03\x04" + bytes(64), "magic number"),
    ("version", _header([], version=99), "version 99"),
    ("unknown-type", _header([_string("general.x") + struct.pack("<I", 77)]), "value type 77"),
    ("strings-past-end", _header([_array("tokenizer.ggml.tokens", STRING, 3, _string("a") + _string("b"))]), "past the end"),
])
def test_a_hostile_header_is_refused_in_one_line_at_once(tmp_path, name, data, why):
    path = _write(tmp_path, f"{name}.gguf", data)
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match=why) as caught:
            check_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20  # refused before reading what the header claims (at most 16 MiB a string, 2 Mi entries)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_the_arrays_together_are_bounded_by_what_the_reader_can_afford_and_the_largest_real_vocabulary_passes(tmp_path):
    ints = _header([_array(f"x.{k}", UINT32, 1 << 21, bytes(4 << 21)) for k in "ab"])  # 16 MB: 36 s, 2.8 GB to parse
    with pytest.raises(ModelError, match="more than 2,500,000 entries together .* more than 1.7 GB"):
        check_gguf(_write(tmp_path, "ints.gguf", ints))
    tokens = b"".join(_string(f"t{i}") for i in range(262_144))
    merges = b"".join(_string(f"m {i}") for i in range(514_906))
    largest = _header([_array("tokenizer.ggml.tokens", STRING, 262_144, tokens),  # Gemma 4's vocabulary's shape
                       _array("tokenizer.ggml.scores", 6, 262_144, bytes(4 * 262_144)),
                       _array("tokenizer.ggml.token_type", 5, 262_144, bytes(4 * 262_144)),
                       _array("tokenizer.ggml.merges", STRING, 514_906, merges)])
    check_gguf(_write(tmp_path, "largest.gguf", largest))


@pytest.mark.slow
def test_real_files_pass(tmp_path, gguf_file):
    check_gguf(embedded_model_file())
    check_gguf(gguf_file)
    small = _write(tmp_path, "small.gguf", _header([_array("general.list", STRING, 2, _string("a") + _string("bc"))], ))
    check_gguf(small)


def test_the_verdict_follows_the_files_version(tmp_path):
    path = _write(tmp_path, "m.gguf", _header([_array("general.list", STRING, 1, _string("a"))]))
    check_gguf(path)
    path.write_bytes(_header([_array("general.junk", UINT32, 20_000_000)]))
    with pytest.raises(ModelError, match="20,000,000 entries"):
        check_gguf(path)

@pytest.mark.slow

def test_a_gguf_file_with_a_hostile_chat_template_is_refused_before_the_model_loads(tmp_path):
    """The tokenizer of a GGUF file whose template would build 2 GB loads; the prompt it is asked
    to render is refused in one line, and no weights are converted."""
    from prefixcache.model.load import converted_dir, load_tokenizer, resolve_model
    from prefixcache.task.prompt import PromptBuilder
    from prefixcache.task.keys import spec_from_mapping

    tail = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_gguf(tmp_path / "bomb.gguf", chat_template="{{ 'x' * 2000000000 }}" + tail)
    source = resolve_model(str(path))
    tokenizer = load_tokenizer(source, tmp_path / "cache")
    spec = spec_from_mapping({"system": "Sort tickets.", "labels": ["billing", "bug"], "format": "chat"})
    with pytest.raises(ModelError, match="2,000,000,000 characters"):
        PromptBuilder(spec, tokenizer)
    assert not (converted_dir(source, tmp_path / "cache") / "config.json").exists()
