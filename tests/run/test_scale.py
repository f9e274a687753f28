"""Scaling out: --shard K/N + merge, and a 2-process CPU launch through accelerate (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TEXTS, free_port, invoke, records as _records, write_spec





@pytest.fixture()
def job(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "technical", "billing"])
    items = tmp_path / "in.jsonl"
    texts = [f"{t} (case {n})" for n, t in enumerate(TEXTS * 3)]
    items.write_text("".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(texts)))
    single = tmp_path / "single.jsonl"
    result = invoke("run", str(spec), str(items), "-o", str(single), "-b", 4, "-q")
    assert result.exit_code == 0, result.output
    return spec, items, single


def _shard(spec, items, out, k, n):
    return invoke("run", str(spec), str(items), "-o", str(out), "-b", 4, "-q", "--shard", f"{k}/{n}")


def test_shards_merge_to_the_single_process_output(job, tmp_path):
    spec, items, single = job
    parts = [tmp_path / f"part{k}.jsonl" for k in (1, 2, 3)]
    for k, part in enumerate(parts, 1):
        assert _shard(spec, items, part, k, 3).exit_code == 0
    sizes = [len(_records(p)) for p in parts]
    assert sum(sizes) == len(_records(single)) and all(sizes)
    out = tmp_path / "merged.jsonl"
    result = invoke("merge", str(parts[2]), str(parts[0]), str(parts[1]), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stderr == f"merged {sum(sizes)} records from 3 parts into {out}\n"
    assert _records(out) == _records(single)


def test_merge_reports_missing_incomplete_or_duplicate_shards(job, tmp_path):
    spec, items, _ = job
    parts = [tmp_path / f"part{k}.jsonl" for k in (1, 2, 3)]
    for k, part in enumerate(parts, 1):
        assert _shard(spec, items, part, k, 3).exit_code == 0
    out = str(tmp_path / "merged.jsonl")
    missing = invoke("merge", str(parts[0]), str(parts[2]), "-o", out)
    assert missing.exit_code == 2
    assert missing.stderr == "error: shard 2/3 missing (expected 3 parts written with --shard K/3)\n"
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(parts[0].read_bytes())
    Path(str(copy) + ".prefixcache.json").write_bytes(Path(str(parts[0]) + ".prefixcache.json").read_bytes())
    twice = invoke("merge", str(parts[0]), str(copy), str(parts[1]), "-o", out)
    assert twice.exit_code == 2 and "are both shard 1/3" in twice.stderr
    lines = parts[1].read_text().splitlines(keepends=True)
    parts[1].write_text("".join(lines[:-1]))
    short = invoke("merge", *map(str, parts), "-o", out)
    assert short.exit_code == 2
    assert f"{parts[1]}: has {len(lines) - 1} of its {len(lines)} records; finish it with --resume" in short.stderr
    assert not Path(out).exists()
    assert _shard(spec, items, parts[1], 2, 3).exit_code == 2  # exists: refused
    resumed = invoke("run", str(spec), str(items), "-o", str(parts[1]), "-b", 4, "-q", "--shard", "2/3", "--resume")
    assert resumed.exit_code == 0
    assert invoke("merge", *map(str, parts), "-o", out).exit_code == 0
    assert invoke("run", str(spec), str(items), "--shard", "4/3").stderr.startswith("error: --shard must look like K/N")


@pytest.mark.slow
def test_two_cpu_processes_with_accelerate_launch(job, tmp_path):
    spec, items, single = job
    out = tmp_path / "launched.jsonl"
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
         "-m", "prefixcache", "run", str(spec), str(items), "-o", str(out), "-b", "4"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shard 1/2:" in proc.stderr and "shard 2/2:" in proc.stderr
    assert f"merged {len(_records(single))} records from 2 processes into {out}" in proc.stderr
    assert _records(out) == _records(single)
    assert sorted(p.name for p in tmp_path.glob("launched*")) == ["launched.jsonl", "launched.jsonl.prefixcache.json"]


def test_merge_of_a_missing_part_says_not_found(tmp_path):
    result = invoke("merge", tmp_path / "missing.jsonl", "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and result.stderr == f"error: {tmp_path / 'missing.jsonl'}: not found\n"
