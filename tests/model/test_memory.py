"""The memory a model will take, said and checked before it loads (model/memory.py)."""

from __future__ import annotations

import json

from helpers import TEXTS, invoke, write_spec

from prefixcache.model.load import ModelSource, embedded_model_file
from prefixcache.model.memory import RUNTIME, footprint


def test_a_folders_footprint_is_its_parameters_at_the_precision_and_its_keys_and_values(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    c = model.config
    parameters = sum(p.numel() for p in model.parameters())
    got = footprint(ModelSource("tiny", "dir", str(tiny_model_dir)), tmp_path, 2, tokens=100)
    head_dim = c.hidden_size // c.num_attention_heads
    assert got.weights == 2 * parameters  # bfloat16: 2 bytes a number, every tensor of the files counted
    assert got.kv == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * 100
    assert got.conversion == 0 and got.total == got.weights + got.kv + RUNTIME
    assert got.words().startswith(f"about {got.total / 1e9:.2f} GB (weights")


def test_a_gguf_files_footprint_is_read_from_its_tensor_table_with_the_conversion_first(tmp_path):
    path = embedded_model_file()
    got = footprint(ModelSource("embedded", "gguf", str(path)), tmp_path, 4, tokens=1000)
    assert got.weights == 4 * 134_515_008  # SmolLM2-135M's numbers, float32
    assert got.kv == 2 * 30 * 3 * 64 * 4 * 1000  # 30 layers, 3 key/value heads of 64
    assert got.conversion > 0 and "converting the GGUF file first" in got.words()


def test_a_model_that_would_not_fit_is_refused_before_it_loads_unless_told(tmp_path, tiny_model_dir, monkeypatch):
    from prefixcache.scoring import scorer

    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS[:2])))
    said = invoke("run", spec, items, "-o", tmp_path / "fits.jsonl")
    assert said.exit_code == 0 and "memory: " in said.stderr and " will take about " in said.stderr
    monkeypatch.setattr(scorer, "available", lambda: 1000)  # a machine with 1 kB free
    refused = invoke("run", spec, items, "-o", tmp_path / "out.jsonl")
    assert refused.exit_code == 3, refused.output
    assert "and this machine has 0.00 GB available on cpu" in refused.stderr and "PREFIXCACHE_NO_MEMORY_CHECK=1" in refused.stderr
    assert not (tmp_path / "out.jsonl").exists()
    monkeypatch.setenv("PREFIXCACHE_NO_MEMORY_CHECK", "1")
    assert invoke("run", spec, items, "-o", tmp_path / "out.jsonl").exit_code == 0


def test_a_model_whose_files_are_not_here_gets_no_estimate_and_no_check(tmp_path):
    assert footprint(ModelSource("org/model", "hub", "org/model"), tmp_path, 4, tokens=10) is None
