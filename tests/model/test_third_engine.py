"""A third engine is one module and one registry line (tests/toy_engine.py): a spec then runs on it
end to end, its records equal to the transformers engine's, its name in the output's identity
(a resume under another engine refused naming both), its limits checked before the model loads,
and its prefix kept by the prefix store without the store knowing its type."""

from __future__ import annotations

import json

import pytest
from helpers import invoke, records, write_spec
from toy_engine import NAME, register_toy

from prefixcache.model import engines
from prefixcache.model.choice import engines as engine_names

TEXTS = ["I was charged twice, please refund me.", "The app crashes on start.", "I cannot sign in.",
         "Where is my March invoice?"]


@pytest.fixture()
def toy():
    backend = register_toy()
    yield backend
    engines.unregister(NAME)


@pytest.fixture()
def items(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    return path


def _close(a: dict, b: dict, tol: float = 1e-4) -> bool:
    return a["label"] == b["label"] and all(abs(a["probs"][k] - b["probs"][k]) <= tol for k in a["probs"])


def test_a_registered_engine_runs_a_spec_as_the_transformers_engine_does(toy, tmp_path, tiny_model_dir, items):
    assert NAME in engine_names()
    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    want = invoke("run", spec, items, "-o", tmp_path / "tf.jsonl", "--cache-dir", tmp_path / "cache")
    got = invoke("run", spec, items, "-o", tmp_path / "toy.jsonl", "--backend", NAME, "--cache-dir", tmp_path / "cache")
    assert want.exit_code == got.exit_code == 0, got.output
    assert f"backend: {NAME}" in got.stderr
    pairs = list(zip(records(tmp_path / "tf.jsonl"), records(tmp_path / "toy.jsonl"), strict=True))
    assert pairs and all(_close(a, b) for a, b in pairs)
    identity = json.loads((tmp_path / "toy.jsonl.prefixcache.json").read_text())
    assert identity["engine"] == NAME
    # its prefix was kept and is read back by the second run, the store knowing nothing of its type
    again = invoke("run", spec, items, "-o", tmp_path / "toy2.jsonl", "--backend", NAME, "--cache-dir",
                   tmp_path / "cache")
    assert again.exit_code == 0 and records(tmp_path / "toy2.jsonl") == records(tmp_path / "toy.jsonl")
    # the output is tied to its engine: continuing it under another is refused, naming both
    items.write_text(items.read_text() + json.dumps({"id": 9, "text": "Refund please."}) + "\n")
    refused = invoke("run", spec, items, "-o", tmp_path / "toy.jsonl", "--resume", "--cache-dir", tmp_path / "cache")
    assert refused.exit_code != 0 and NAME in refused.stderr and "transformers" in refused.stderr


@pytest.mark.usefixtures("races_of_any_size")
def test_a_race_runs_on_an_engine_through_its_open_items_as_on_transformers(toy, tmp_path, tiny_model_dir, items):
    """Pruned scoring asks an engine for nothing but `open_items`: the toy's (every node re-encoded)
    races to the records of the transformers engine's kept keys and values."""
    labels = ["billing", "bug", "login", "refund"] + [f"{w} and then some more words" for w in ("apple", "river", "garden")]
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=labels)
    outs = {}
    for backend in ("transformers", NAME):
        outs[backend] = tmp_path / f"{backend}.jsonl"
        result = invoke("run", spec, items, "-o", outs[backend], "--backend", backend, "--prune", "on",
                        "--cache-dir", tmp_path / "cache")
        assert result.exit_code == 0 and "every label is scored" not in result.stderr, result.output
    pairs = list(zip(records(outs["transformers"]), records(outs[NAME]), strict=True))
    assert all(_close(a, b) and a["pruned"] == b["pruned"] for a, b in pairs)
    assert sum(len(a["pruned"]) for a, _ in pairs) > 0


def test_a_taken_name_is_refused_by_every_registry(toy):
    from prefixcache.model import precision
    from prefixcache.task import kind

    with pytest.raises(ValueError, match=f"an engine named '{NAME}' is registered already"):
        register_toy()
    with pytest.raises(ValueError, match="an engine named 'transformers' is registered already"):
        engines.register(engines.backend_named("transformers"))
    with pytest.raises(ValueError, match="a precision named 'int8' is registered already"):
        precision.register(precision.precision_named("int8"))
    with pytest.raises(ValueError, match="a question kind named 'choice' is registered already"):
        kind.register(kind.KINDS["choice"])


def test_an_engines_limit_on_candidates_is_refused_before_the_model_loads(tmp_path, tiny_model_dir, items):
    register_toy(max_leaves=2)
    try:
        spec = write_spec(tmp_path, model=str(tiny_model_dir), backend=NAME)  # six labels: more leaves than two
        refused = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "--cache-dir", tmp_path / "cache")
    finally:
        engines.unregister(NAME)
    assert refused.exit_code == 3 and f"{NAME} sequences an item, more than its 2" in refused.stderr
    assert "memory:" not in refused.stderr  # refused before the memory check and the load
    assert not (tmp_path / "out.jsonl").exists() or not records(tmp_path / "out.jsonl")


def test_an_engine_without_hidden_states_is_refused_for_heads_fit_and_suggest_before_the_model_loads(
        tmp_path, tiny_model_dir, items):
    import numpy as np

    from prefixcache.task.head import Readout, head_bytes

    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps({"id": n, "text": t, "gold": ["billing", "technical"][n % 2]}) + "\n"
                                for n, t in enumerate(TEXTS * 4)))
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["billing", "technical"])
    readout = Readout("label", ("billing", "technical"), False, "state", np.zeros((1, 4)), np.ones((1, 4)),
                      np.zeros((2, 4)), np.zeros(2))  # a head file as fit writes one (no model reads it here)
    fingerprint = {"model": "m" * 32, "prefix": "p" * 32, "template": "t" * 32, "questions": "q" * 32}
    (tmp_path / "f.head.safetensors").write_bytes(head_bytes([readout], fingerprint, "final", {}))
    (tmp_path / "f.yaml").write_text(spec.read_text() + "head: f.head.safetensors\n")
    register_toy(reads_states=False)
    try:
        for args in (("fit", spec, labelled, "--gold", "gold", "-o", tmp_path / "g.yaml"),
                     ("suggest", spec, items, "-n", "2", "-o", tmp_path / "s.csv"),
                     ("run", tmp_path / "f.yaml", items, "-o", tmp_path / "out.jsonl")):
            refused = invoke(*args, "--backend", NAME, "--cache-dir", tmp_path / "cache")
            assert refused.exit_code == 2, (args[0], refused.output)
            assert f"the {NAME} engine gives none: choose another with --backend" in refused.stderr
            assert "memory:" not in refused.stderr  # before the memory check and the load
        drawn = invoke("suggest", spec, items, "-n", "2", "--random", "-o", tmp_path / "r.csv", "--backend", NAME)
        assert drawn.exit_code == 0, drawn.output  # a random sample reads no state
    finally:
        engines.unregister(NAME)


def test_an_unregistered_engine_in_a_spec_is_refused_naming_the_engines_there_are(tmp_path, tiny_model_dir, items):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), backend=NAME)
    refused = invoke("run", spec, items, "-o", tmp_path / "out.jsonl")
    assert refused.exit_code == 2 and "backend must be one of auto, transformers, llama.cpp" in refused.stderr


def test_an_unknown_backend_asked_on_the_command_line_is_refused_in_one_line(tmp_path, tiny_model_dir, items):
    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    refused = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "--backend", "vllm")
    assert refused.exit_code == 2 and "memory:" not in refused.stderr
    assert refused.stderr.strip().endswith("unknown backend 'vllm': choose one of auto, transformers, llama.cpp")


def test_an_unknown_backend_is_refused_before_the_output_is_looked_at(tmp_path, tiny_model_dir, items):
    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    (tmp_path / "out.jsonl").write_text("")  # an output that exists would be refused too: the backend is said first
    refused = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "--backend", "vllm")
    assert refused.exit_code == 2 and "unknown backend 'vllm'" in refused.stderr
