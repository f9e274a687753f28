"""A Ray Data job resumed from Ray's row-level checkpoint answers as the job it continues: the
fingerprint kept in the checkpoint folder is compared as each actor starts (no Ray cluster needed:
Ray Data's context is a plain object), and a spec's fingerprint is the same in every process."""

from __future__ import annotations

import json

import pytest
from helpers import QUESTIONS, write_spec

from prefixcache.errors import UsageError
from prefixcache.scoring.raycheckpoint import FILE, check_resumed_job
from prefixcache.task.specfile import load_spec

ray_data = pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'prefixcache[ray]')")


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    from ray.data.checkpoint import CheckpointConfig

    context = ray_data.DataContext.get_current()
    monkeypatch.setattr(context, "checkpoint_config", CheckpointConfig(id_column="id", checkpoint_path=str(tmp_path / "ck")))
    return tmp_path / "ck"


def test_a_checkpoint_with_rows_of_another_job_is_refused_and_one_without_rows_starts_anew(checkpoint):
    first = {"model": "m1", "spec": "s1", "engine": "transformers", "precision": "float32"}
    check_resumed_job(first)  # a new job: its fingerprint kept
    assert json.loads((checkpoint / FILE).read_text()) == first
    check_resumed_job(dict(first))  # another actor of the job, or the job resumed as it was
    other = {**first, "spec": "s2", "precision": "bfloat16"}
    check_resumed_job(other)  # no row written yet: a new job in the folder, its fingerprint kept instead
    (checkpoint / "rows_000000.parquet").write_bytes(b"rows")  # Ray kept rows of that job
    with pytest.raises(UsageError, match="holds rows of a job with another precision and spec"):
        check_resumed_job(first)
    assert json.loads((checkpoint / FILE).read_text()) == other  # kept as it was
    check_resumed_job(other)


def test_without_a_checkpoint_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_data.DataContext.get_current(), "checkpoint_config", None)
    check_resumed_job({"model": "m"})
    assert list(tmp_path.iterdir()) == []


def test_a_specs_representation_holds_no_address_of_this_process(tmp_path):
    """Kept bounds and Ray's checkpoint fingerprints are digests of a spec's representation: a
    question kind's used to print its memory address, so no two processes agreed."""
    spec = load_spec(write_spec(tmp_path, model="m", questions=QUESTIONS))
    assert "0x" not in repr(spec) and "<kind choice>" in repr(spec)
