"""--dtype int8 (torchao's int8 weights and per-token int8 activations on the transformers engine):
the records say int8, an item's numbers do not move with its neighbours or its place, --exact
gives float32's labels, and it is refused or warned of in one line where it cannot pay."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import TEXTS, invoke, json_lines, write_spec

from prefixcache import compat
from prefixcache.model import int8

pytest.importorskip("torchao")


@pytest.fixture()
def job(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(compat, "int8_matmul", lambda device: True)  # the int8 pass on any CPU
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "technical", "billing", "account access"])
    rows = [{"id": n, "text": f"{t} (case {n})"} for n, t in enumerate(TEXTS * 2)]
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = tmp_path / "fp32.jsonl"
    assert invoke("run", spec, items, "-o", plain, "-b", 4, "-q").exit_code == 0
    return spec, items, rows, json_lines(plain)


def _run(spec, items, out, *more):
    result = invoke("run", spec, items, "-o", out, "--dtype", "int8", *more)
    assert result.exit_code == 0, result.output
    return result, {r["id"]: r for r in json_lines(out)}


def test_records_say_int8_and_a_rerun_with_the_same_batches_gives_the_same_bits(job, tmp_path):
    """Per-token activation scales keep a row's linear layers to itself, but a float difference of
    the last bit elsewhere (attention over another batch shape) can move a value across an int8
    step: like llama.cpp's quantised kernels, int8 records are reproducible with the same batches
    (which the fingerprint keeps for a resume), and move a little with other batches."""
    spec, items, _, fp32 = job
    result, first = _run(spec, items, tmp_path / "first.jsonl", "-b", 8)
    assert "cpu int8" in result.stderr and "linear layers quantised" in result.stderr
    fingerprint = json.loads((tmp_path / "first.jsonl.prefixcache.json").read_text())
    assert fingerprint["dtype"] == "int8" and fingerprint["engine"] == "transformers"
    assert fingerprint["batch_size"] == 8 and fingerprint["scores_move_with_batch"] is True
    float32 = json.loads((tmp_path / "fp32.jsonl.prefixcache.json").read_text())
    assert float32["scores_move_with_batch"] is False
    assert "; torchao " in fingerprint["engine_version"] and "torchao" not in float32["engine_version"]
    _, again = _run(spec, items, tmp_path / "again.jsonl", "-b", 8)
    assert again == {k: {**r, "ms": again[k]["ms"]} for k, r in first.items()}
    drift = max(abs(first[r["id"]]["logprobs"][k] - r["logprobs"][k]) for r in fp32 for k in r["logprobs"])
    assert drift > 1e-6  # int8 did compute: its numbers are not float32's


def test_exact_gives_float32_labels_and_rescored_records_are_float32_records(job, tmp_path):
    spec, items, _, fp32 = job
    result, records = _run(spec, items, tmp_path / "exact.jsonl", "-b", 4, "--exact")
    assert [records[r["id"]]["label"] for r in fp32] == [r["label"] for r in fp32]
    precisions = {r["precision"] for r in records.values()}
    assert precisions <= {"int8", "float32"}
    assert "items re-scored in float32" in result.stderr
    for want in fp32:
        got = records[want["id"]]
        if got["precision"] == "float32":
            assert max(abs(got["logprobs"][k] - want["logprobs"][k]) for k in want["logprobs"]) < 1e-5


def test_a_resume_in_float32_of_an_int8_output_is_refused(job, tmp_path):
    spec, items, _, _ = job
    out = tmp_path / "int8.jsonl"
    _run(spec, items, out, "-b", 4)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]))
    result = invoke("run", spec, items, "-o", out, "--resume", "--dtype", "float32")
    assert result.exit_code != 0 and "int8" in result.stderr and "float32" in result.stderr, result.output
    assert "move with the batch" not in result.stderr  # follows from the precision: named once, as the dtype


def test_without_torchao_it_is_refused_in_one_line_before_the_model_loads(job, tmp_path, monkeypatch):
    spec, items, _, _ = job
    monkeypatch.setattr(int8, "installed", lambda: False)
    result = invoke("run", spec, items, "-o", tmp_path / "x.jsonl", "--dtype", "int8")
    assert result.exit_code == 2 and "needs torchao" in result.stderr and "pip install" in result.stderr
    assert "loading" not in result.stderr.lower() and len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = invoke("run", spec, items, "-o", tmp_path / "x.jsonl", "--dtype", "int8", "--backend", "transformers")
    assert result.exit_code == 2 and "--backend transformers: --dtype int8 needs torchao" in result.stderr


def test_a_cpu_without_int8_dot_products_is_warned_of(job, tmp_path, monkeypatch, caplog):
    spec, items, _, _ = job
    monkeypatch.setattr(compat, "int8_matmul", lambda device: False)
    with caplog.at_level(logging.WARNING):
        result = invoke("run", spec, items, "-o", tmp_path / "w.jsonl", "--dtype", "int8")
    assert result.exit_code == 0, result.output
    assert "no int8 dot-product instructions" in result.stderr + caplog.text

@pytest.mark.slow

def test_with_torchao_installed_the_python_api_prints_nothing_of_its_import(tmp_path, tiny_model_dir):
    """transformers imports torchao wherever it is installed, and torchao warns of GPU kernels a
    CPU build cannot load: a classifier's caller sees none of it."""
    import subprocess
    import sys

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "billing"])
    code = ("from prefixcache.api.classifier import Classifier; "
            f"print(Classifier({str(spec)!r}, progress=False, cache_dir={str(tmp_path / 'cache')!r}).predict(['a bug']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "register_constant" not in done.stderr, done.stderr
