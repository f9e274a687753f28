"""The memory a model will take, said and checked before it loads (model/memory.py)."""

from __future__ import annotations

import json

from helpers import TEXTS, invoke, write_spec

from prefixcache.model.load import ModelSource, embedded_model_file
from prefixcache.model.memory import RUNTIME, TOKENIZER_BYTES, footprint


def test_a_folders_footprint_is_its_parameters_at_the_precision_and_its_keys_and_values(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    c = model.config
    parameters = sum(p.numel() for p in model.parameters())
    got = footprint(ModelSource("tiny", "dir", str(tiny_model_dir)), tmp_path, 2, tokens=100)
    head_dim = c.hidden_size // c.num_attention_heads
    assert got.weights == 2 * parameters  # bfloat16: 2 bytes a number, every tensor of the files counted
    assert got.kv == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * 100
    assert got.runtime == RUNTIME + TOKENIZER_BYTES * c.vocab_size  # its tokenizer counted with the runtime
    assert got.conversion == 0 and got.total == got.weights + got.kv + got.runtime
    assert got.words().startswith(f"about {got.total / 1e9:.2f} GB (weights")


def test_a_gguf_files_footprint_is_read_from_its_tensor_table_with_the_conversion_first(tmp_path):
    path = embedded_model_file()
    got = footprint(ModelSource("embedded", "gguf", str(path)), tmp_path, 4, tokens=1000)
    assert got.weights == 4 * 134_515_008  # SmolLM2-135M's numbers, float32
    assert got.kv == 2 * 30 * 3 * 64 * 4 * 1000  # 30 layers, 3 key/value heads of 64
    assert got.runtime == RUNTIME + TOKENIZER_BYTES * 49152  # and 49,152 tokens
    assert got.conversion > 0 and "converting the GGUF file first" in got.words()


def test_a_model_that_would_not_fit_is_refused_before_it_loads_unless_told(tmp_path, tiny_model_dir, monkeypatch):
    from prefixcache.model import engines

    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS[:2])))
    said = invoke("run", spec, items, "-o", tmp_path / "fits.jsonl")
    assert said.exit_code == 0 and "memory: " in said.stderr and " will take about " in said.stderr
    monkeypatch.setattr(engines, "available_and_why", lambda: (1000, "this machine"))  # a machine with 1 kB free
    refused = invoke("run", spec, items, "-o", tmp_path / "out.jsonl")
    assert refused.exit_code == 3, refused.output
    assert "and this machine has 0.00 GB available on cpu" in refused.stderr and "PREFIXCACHE_NO_MEMORY_CHECK=1" in refused.stderr
    assert not (tmp_path / "out.jsonl").exists()
    monkeypatch.setenv("PREFIXCACHE_NO_MEMORY_CHECK", "1")
    assert invoke("run", spec, items, "-o", tmp_path / "out.jsonl").exit_code == 0


def test_a_model_whose_files_are_not_here_gets_no_estimate_and_no_check(tmp_path):
    assert footprint(ModelSource("org/model", "hub", "org/model"), tmp_path, 4, tokens=10) is None


def _cgroup_v2(tmp_path, limits: dict[str, str], current: int, inactive: int):
    root = tmp_path / "v2"
    (root / "slice" / "job").mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for where, limit in limits.items():
        folder = root / where
        (folder / "memory.max").write_text(limit + "\n")
        (folder / "memory.current").write_text(f"{current}\n")
        (folder / "memory.stat").write_text(f"anon {current - inactive}\ninactive_file {inactive}\nactive_file 0\n")
    membership = tmp_path / "cgroup-v2"
    membership.write_text("0::/slice/job\n")
    return membership, root


def test_a_cgroup_v2_limit_bounds_the_memory_available(tmp_path):
    """The headroom is the limit less the usage that cannot be reclaimed, the least of the
    process's cgroup and those above it; "max" is no limit."""
    from prefixcache.model.memory import cgroup_headroom

    mb = 1 << 20
    membership, root = _cgroup_v2(tmp_path, {"slice/job": str(500 * mb), "slice": "max"}, 300 * mb, 100 * mb)
    assert cgroup_headroom(membership, root) == 300 * mb
    membership, root = _cgroup_v2(tmp_path, {"slice/job": "max", "slice": str(250 * mb)}, 300 * mb, 100 * mb)
    assert cgroup_headroom(membership, root) == 50 * mb  # the parent's limit binds
    membership, root = _cgroup_v2(tmp_path, {"slice/job": "max", "slice": "max"}, 300 * mb, 100 * mb)
    assert cgroup_headroom(membership, root) is None


def test_a_cgroup_v1_limit_bounds_the_memory_available(tmp_path):
    from prefixcache.model.memory import cgroup_headroom

    mb = 1 << 20
    root = tmp_path / "v1"
    job = root / "memory" / "batch" / "slot"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text(f"{500 * mb}\n")
    (job / "memory.usage_in_bytes").write_text(f"{200 * mb}\n")
    (job / "memory.stat").write_text(f"cache {50 * mb}\ntotal_inactive_file {50 * mb}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the root: no limit
    membership = tmp_path / "cgroup-v1"
    membership.write_text("5:cpu,cpuacct:/\n4:memory:/batch/slot\n0::/\n")
    assert cgroup_headroom(membership, root) == 350 * mb


def test_a_model_over_its_cgroups_limit_is_refused_naming_the_limit(tmp_path, tiny_model_dir, monkeypatch):
    from prefixcache.model import memory

    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"id": 1, "text": TEXTS[0]}) + "\n")
    monkeypatch.setattr(memory, "cgroup_headroom", lambda: 1000)
    refused = invoke("run", spec, items, "-o", tmp_path / "out.jsonl")
    assert refused.exit_code == 3, refused.output
    assert "this process's cgroup (its memory limit) has 0.00 GB available on cpu" in refused.stderr
