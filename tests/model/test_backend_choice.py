"""Which engine runs a model: what `auto` picks (a GGUF file of about a billion parameters or more
on llama.cpp when it is installed, unless its weights stay small on transformers and the CPU has a
bfloat16 matrix unit; anything else on transformers) and what asking for llama.cpp refuses, in one
line, before anything loads."""

from __future__ import annotations

import pytest

from prefixcache.errors import UsageError
from prefixcache.model import choice, llamacpp
from prefixcache.model.choice import AUTO_FLOAT32_BYTES, pick_engine
from prefixcache.model.load import ModelSource

GGUF = ModelSource("m.gguf", "gguf", "/models/m.gguf")
FOLDER = ModelSource("./m", "dir", "/models/m")
BIG, SMALL = AUTO_FLOAT32_BYTES * 2, AUTO_FLOAT32_BYTES // 10


@pytest.fixture()
def llama_installed(monkeypatch):
    monkeypatch.setattr(llamacpp, "installed", lambda: True)
    monkeypatch.setattr(llamacpp, "gpu_build", lambda: False)


def test_auto_keeps_a_large_gguf_file_quantised_and_the_rest_on_transformers(llama_installed):
    assert pick_engine(GGUF, None, float32_bytes=BIG).name == "llama.cpp"
    assert pick_engine(GGUF, "auto", float32_bytes=SMALL).name == "transformers"
    assert pick_engine(GGUF, "auto", float32_bytes=None).name == "transformers"  # size not known
    assert pick_engine(FOLDER, "auto", float32_bytes=BIG) == choice.Picked("transformers", "not a GGUF file")
    assert pick_engine(GGUF, "llama.cpp").why == pick_engine(GGUF, "transformers").why == choice.ASKED  # said too
    # what llama.cpp cannot do keeps auto on transformers, and says why
    assert "--dtype bfloat16" in pick_engine(GGUF, "auto", dtype="bfloat16", float32_bytes=BIG).why
    assert pick_engine(GGUF, "auto", exact=True, float32_bytes=BIG).name == "transformers"
    assert pick_engine(GGUF, "auto", device="cuda", float32_bytes=BIG).name == "transformers"


@pytest.mark.parametrize("unit", [True, False])
def test_auto_keeps_a_gguf_file_on_transformers_where_its_weights_stay_small_and_bfloat16_has_a_unit(
        llama_installed, monkeypatch, gguf_file, unit):
    """A file the default engine reads with its weights kept (about the file's size), on a CPU with
    a bfloat16 matrix unit, --dtype auto or bfloat16: transformers, however large; without the
    unit, or weights that would not stay small, the size rule."""
    from prefixcache import compat
    from prefixcache.model import memory

    monkeypatch.setattr(compat, "bf16_matmul", lambda device: unit)
    source = ModelSource(str(gguf_file), "gguf", str(gguf_file))
    picked = pick_engine(source, "auto", device="cpu", float32_bytes=BIG)
    assert picked.name == ("transformers" if unit else "llama.cpp")
    assert ("bfloat16 unit" in picked.why) is unit
    assert pick_engine(source, "auto", device="cpu", dtype="bfloat16", float32_bytes=BIG).name == "transformers"
    size = gguf_file.stat().st_size
    monkeypatch.setattr(memory, "kept_weight_bytes", lambda path, dtype_bytes: int(size * choice.KEPT_SIZE) + 1)
    assert pick_engine(source, "auto", device="cpu", float32_bytes=BIG).name == "llama.cpp"


def test_auto_without_llama_cpp_installed_is_transformers(monkeypatch):
    monkeypatch.setattr(llamacpp, "installed", lambda: False)
    picked = pick_engine(GGUF, "auto", float32_bytes=BIG)
    assert picked.name == "transformers" and "pip install 'prefixcache[llama]'" in picked.why


@pytest.mark.parametrize("source, asked, words", [
    (FOLDER, dict(), "llama.cpp reads GGUF files, and ./m is not one"),
    (GGUF, dict(exact=True), "--exact scores close calls again in float32"),
    (GGUF, dict(dtype="float16"), "--dtype float16: llama.cpp computes in the GGUF file's own types"),
    (GGUF, dict(device="cuda:1"), "--device cuda:1: this llama.cpp was built for the CPU only"),
])
def test_asking_for_llama_cpp_refuses_what_it_cannot_do(llama_installed, source, asked, words):
    with pytest.raises(UsageError, match="^--backend llama.cpp: ") as refused:
        pick_engine(source, "llama.cpp", **asked)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(llamacpp, "installed", lambda: False)
    with pytest.raises(UsageError, match=r"llama-cpp-python is not installed: pip install 'prefixcache\[llama\]'"):
        pick_engine(GGUF, "llama.cpp")


def test_an_unknown_backend_is_refused():
    with pytest.raises(UsageError, match="unknown backend 'vllm'"):
        pick_engine(GGUF, "vllm")
    assert pick_engine(GGUF, "transformers").name == "transformers"


@pytest.mark.slow
def test_every_gguf_run_says_its_engine_its_precision_and_why(tmp_path, monkeypatch, gguf_file, gguf_parsed):
    """A GGUF file may be expanded or kept quantised: the run says which, in what, and why, even
    where auto chose the default engine (a folder's run says nothing of it)."""
    import json

    from conftest import seed_cache
    from helpers import TEXTS, invoke, write_spec

    monkeypatch.setattr(llamacpp, "installed", lambda: True)
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(seed_cache(gguf_parsed, tmp_path / "cache")))
    spec = write_spec(tmp_path, model=str(gguf_file))
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(TEXTS[:2])))
    result = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stderr.splitlines() if "backend:" in x)
    assert line.endswith("backend: transformers, bfloat16 (--dtype bfloat16: llama.cpp computes in the GGUF "
                         "file's own types (transformers runs --dtype))")
    result = invoke("run", spec, items, "-o", tmp_path / "out2.jsonl")
    line = next(x for x in result.stderr.splitlines() if "backend:" in x)
    assert "backend: transformers, float32 (a GGUF model 0.0 GB as float32: expanded from its quantisation, " \
           "which runs faster below 4 GB; --backend llama.cpp keeps it quantised)" in line
