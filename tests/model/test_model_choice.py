"""Choosing the model without editing the spec: -m/--model, PREFIXCACHE_MODEL, revision."""

from __future__ import annotations

import json

import pytest
from helpers import invoke, write_spec

from prefixcache.model.load import model_identity, resolve_model


@pytest.fixture()
def items(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": k, "text": f"ticket {k}"}) + "\n" for k in range(3)))
    return path


def test_option_then_environment_then_spec(tmp_path, tiny_model_dir, items):
    spec = write_spec(tmp_path, model="./no/such/model", labels=["tech", "billing"])
    assert invoke("run", spec, items).exit_code == 3  # the spec's model
    out = tmp_path / "o.jsonl"
    by_option = invoke("run", spec, items, "-m", tiny_model_dir, "-o", out)
    assert by_option.exit_code == 0, by_option.output
    assert f"· {tiny_model_dir} ·" in by_option.stderr.splitlines()[-1]  # named in the summary
    by_env = invoke("run", spec, items, env={"PREFIXCACHE_MODEL": str(tiny_model_dir)})
    assert by_env.exit_code == 0 and len(by_env.stdout.splitlines()) == 3
    both = invoke("run", spec, items, "-m", "./also/missing", env={"PREFIXCACHE_MODEL": str(tiny_model_dir)})
    assert both.exit_code == 3 and both.stderr == "error: model path './also/missing' does not exist\n"
    assert invoke("render", spec, items, "-m", tiny_model_dir, "--limit", 1).exit_code == 0


def test_another_model_is_in_the_fingerprint(tmp_path, tiny_model_dir, items):
    import shutil

    spec = write_spec(tmp_path, labels=["tech", "billing"])
    out = tmp_path / "o.jsonl"
    assert invoke("run", spec, items, "-m", tiny_model_dir, "-o", out, "-q", "--limit", 1).exit_code == 0
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps" '))
    refused = invoke("run", spec, items, "-m", other, "-o", out, "--resume")
    assert refused.exit_code == 2 and "it was written with another model" in refused.stderr


def test_revision_pins_a_hub_model(tmp_path):
    spec = write_spec(tmp_path, model="org/name", revision="v1.2")
    from prefixcache.scoring.prepare import spec_model
    from prefixcache.task.specfile import load_spec

    source = spec_model(load_spec(spec))
    assert (source.kind, source.revision) == ("hub", "v1.2")
    assert model_identity(source) == "hub:org/name@v1.2" != model_identity(resolve_model("org/name"))


def test_a_hub_id_without_network_fails_fast(tmp_path, items, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    spec = write_spec(tmp_path, labels=["a", "b"])
    result = invoke("run", spec, items, "-m", "no-such-org/no-such-model", "--revision", "main")
    assert result.exit_code == 3
    assert result.stderr.startswith("error: cannot load the tokenizer of no-such-org/no-such-model: ")
