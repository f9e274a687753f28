"""Multiple choice, normalisations, calibration and gold evaluation through the scorer and
the CLI, on a tiny model, against naive full forwards."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_model
from helpers import invoke, make_spec, write_spec

from prefixcache.model.engine import Engine
from prefixcache.data.items import read_items
from prefixcache.model.load import ModelSource
from prefixcache.model.reference import score_naive
from prefixcache.run.pipeline import classify
from prefixcache.scoring.scorer import Scorer
from prefixcache.task.decision import calibrate, mean_distribution, softmax
from prefixcache.scoring.prepare import Batching, Task

TOL = 1e-4
QUESTIONS = [
    {"id": 1, "text": "How many legs do horses have?", "choices": ["two", "four", "six", "three"], "answer": "four"},
    {"id": 2, "text": "What is rain made of?", "choices": ["water", "the tears of a very sad cloud that lives far away"],
     "answer": "water"},
    {"id": 3, "text": "Pick one", "choices": ["a"], "answer": "a"},
    {"id": 4, "text": "What does a thermometer measure, in the end?",
     "choices": ["temperature", "tech", "technical support", "te", "humidity and pressure"], "answer": "tech"},
]


def _scorer(spec, tokenizer, arch="llama", init=0.2) -> Scorer:
    task = Task(spec, ModelSource("tiny", "dir", "."), tokenizer)
    return Scorer.start(task, Engine(tiny_model(arch, len(tokenizer), init=init)))


def _items(tmp_path, rows=QUESTIONS, name="q.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_options_scored_like_a_full_forward_per_option(chat_tokenizer, tmp_path, arch, batch_size):
    spec = make_spec(tmp_path, labels=None, choices="choices", template="Q: {text}", normalize="sum")
    clf = _scorer(spec, chat_tokenizer, arch)
    items = list(read_items(str(_items(tmp_path))))
    records = list(classify(clf, items, Batching(size=batch_size)))
    for item, record in zip(items, records, strict=True):
        prep = clf.task.prepare(item)
        assert list(prep.candidates) == item.record["choices"]
        want = score_naive(clf.engine.model, prep.enc.ids, list(prep.candidates.values()))
        assert len(record["logprobs"]) == len(want)
        assert max(abs(a - b) for a, b in zip(record["logprobs"], want, strict=True)) < TOL
        best = max(range(len(want)), key=want.__getitem__)
        assert record["index"] == best and record["label"] == item.record["choices"][best]
        assert sum(record["probs"]) == pytest.approx(1, abs=1e-5)
    # Options sharing leading tokens (tech / technical support / te) were scored in one trie.
    assert len(clf.task.prepare(items[3]).candidates) == 5


@pytest.mark.parametrize("how", ["sum", "mean", "chars", "bytes", "pmi"])
def test_normalisations_in_records(chat_tokenizer, tmp_path, how):
    spec = make_spec(tmp_path, labels=None, choices="choices", template="Q: {text}", normalize=how)
    clf = _scorer(spec, chat_tokenizer)
    items = list(read_items(str(_items(tmp_path))))
    model = clf.engine.model
    cf = clf.task.content_free("")
    for item, record in zip(items, classify(clf, items, Batching(size=2)), strict=True):
        prep = clf.task.prepare(item)
        texts, ids = list(prep.candidates), list(prep.candidates.values())
        lps = score_naive(model, prep.enc.ids, ids)
        if how == "sum":
            scores = lps
        elif how == "mean":
            scores = [lp / len(c) for lp, c in zip(lps, ids, strict=True)]
        elif how == "chars":
            scores = [lp / len(t) for lp, t in zip(lps, texts, strict=True)]
        elif how == "bytes":
            scores = [lp / len(t.encode()) for lp, t in zip(lps, texts, strict=True)]
        else:
            scores = [lp - u for lp, u in zip(lps, score_naive(model, cf.ids, ids), strict=True)]
        assert record["probs"] == pytest.approx(softmax(scores), abs=1e-4)
        assert record["normalize"] == how


def test_label_task_pmi_and_calibration(chat_tokenizer, tmp_path):
    spec = make_spec(tmp_path, labels=["tech", "technical", "billing"], calibrate=["N/A", ""], normalize="pmi")
    clf = _scorer(spec, chat_tokenizer)
    model, cands = clf.engine.model, list(clf.task.builder.candidates.values())
    uncond = score_naive(model, clf.task.content_free("").ids, cands)
    dists = []
    for text in ("N/A", ""):
        lps = score_naive(model, clf.task.content_free(text).ids, cands)
        dists.append(softmax([lp - u for lp, u in zip(lps, uncond, strict=True)]))
    assert len(clf.prior) == 1 and clf.prior[0] == pytest.approx(mean_distribution(dists), abs=1e-5)
    item = next(iter(read_items(str(_items(tmp_path)))))
    record = next(classify(clf, [item]))
    lps = score_naive(model, clf.task.prepare(item).enc.ids, cands)
    raw = softmax([lp - u for lp, u in zip(lps, uncond, strict=True)])
    assert list(record["raw_probs"].values()) == pytest.approx(raw, abs=1e-4)
    assert list(record["probs"].values()) == pytest.approx(calibrate(raw, clf.prior[0]), abs=1e-4)
    assert record["normalize"] == "pmi+calibrated"


def test_threshold_abstains_and_reports_margin(chat_tokenizer, tmp_path):
    item = list(read_items(str(_items(tmp_path))))[:1]
    plain = next(classify(_scorer(make_spec(tmp_path, labels=["tech", "billing"]), chat_tokenizer, init=0.02), item))
    assert plain["prob"] < 1
    above = (plain["prob"] + 1) / 2
    record = next(classify(_scorer(make_spec(tmp_path, labels=["tech", "billing"], threshold=above), chat_tokenizer,
                                   init=0.02), item))
    assert record["label"] is None and record["prob"] is None
    assert record["probs"] == plain["probs"]
    probs = list(record["probs"].values())
    assert record["margin"] == pytest.approx(abs(probs[0] - probs[1]), abs=1e-5)
    below = next(classify(_scorer(make_spec(tmp_path, labels=["tech", "billing"], threshold=plain["prob"] / 2),
                                  chat_tokenizer, init=0.02), item))
    assert below["label"] == plain["label"]


@pytest.fixture()
def mc_spec(tmp_path, tiny_model_dir):
    return write_spec(tmp_path, labels=None, model=str(tiny_model_dir), choices="choices", gold="answer",
                      template="Q: {text}")


def test_cli_multiple_choice_with_gold_reports_and_gate(mc_spec, tmp_path):
    items = _items(tmp_path)
    out, metrics, md, junit = (tmp_path / n for n in ("o.jsonl", "m.json", "s.md", "j.xml"))
    args = ["run", str(mc_spec), str(items), "-o", str(out), "--overwrite", "--metrics", str(metrics), "--summary-md", str(md),
            "--junit", str(junit)]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    correct = sum(r["correct"] for r in records)
    data = json.loads(metrics.read_text())
    assert data["items"] == 4 and data["correct"] == correct and data["accuracy"] == correct / 4
    assert f"accuracy {correct / 4:.3f} ({correct}/4)" in result.stderr
    assert "### prefixcache evaluation" in md.read_text() and "<testsuite" in junit.read_text()

    # The gate, with gold values that make one answer wrong whatever this random model picks: the
    # first question's gold becomes an option it did not choose.
    rows = [dict(q) for q in QUESTIONS]
    rows[0]["answer"] = next(o for o in rows[0]["choices"] if o != records[0]["label"])
    expected = sum(r["label"] == q["answer"] for r, q in zip(records, rows, strict=True)) / 4
    assert expected < 1
    gate_args = ["run", str(mc_spec), str(_items(tmp_path, rows, "wrong.jsonl")), "-o", str(out), "--overwrite"]
    gated = invoke(*gate_args, "--min-accuracy", "1.0")
    assert gated.exit_code == 5
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: " + re.escape(
        f"gate failed: accuracy {expected:.4f} is below --min-accuracy 1.0"), gated.stderr.splitlines()[-1])
    at_the_bound = invoke(*gate_args, "--min-accuracy", expected)
    assert at_the_bound.exit_code == 0, at_the_bound.output


def test_the_log_counts_multiple_choice_answers_by_letter(mc_spec, tmp_path):
    """In a log (stderr not a terminal) the done line counts answers by option letter, not by
    each item's option texts."""
    out = tmp_path / "o.jsonl"
    result = invoke("run", mc_spec, _items(tmp_path), "-o", out)
    assert result.exit_code == 0, result.output
    letters = sorted("ABCDEFGH"[json.loads(line)["index"]] for line in out.read_text().splitlines())
    done = next(line for line in result.stderr.splitlines() if " done: " in line)
    counts = re.search(r"done: 4 records to \S+ \(([^)]*)\)", done).group(1)
    assert sorted(c.split()[0] for c in counts.split(", ")) == sorted(set(letters))
    assert "the tears of a very sad cloud" not in done and "humidity and pressure" not in done


def test_cli_render_shows_options_as_candidates(mc_spec, tmp_path):
    result = invoke("render", str(mc_spec), str(_items(tmp_path)), "--limit", 1)
    assert result.exit_code == 0
    assert list(json.loads(result.stdout)["candidates"]) == ["two", "four", "six", "three"]


def test_cli_gold_errors_before_the_model_loads(mc_spec, tmp_path, tiny_model_dir):
    bad = _items(tmp_path, [{"id": 1, "text": "q", "choices": ["a", "b"], "answer": "c"}])
    result = invoke("run", str(mc_spec), str(bad))
    assert result.exit_code == 2
    assert result.stderr == f"error: {bad}:1: item 1 has gold 'c' (answer), which is not one of its 'choices' (or their letters)\n"
    dup = _items(tmp_path, [{"id": 1, "text": "q", "choices": ["a", "a"], "answer": "a"}], "dup.jsonl")
    result = invoke("run", str(mc_spec), str(dup))
    assert result.exit_code == 2 and "lists option 'a' twice" in result.stderr
    labels = write_spec(tmp_path, name="l.yaml", model=str(tiny_model_dir))
    result = invoke("run", str(labels), str(bad), "--min-accuracy", "0.5")
    assert result.exit_code == 2 and "--min-accuracy needs a gold field" in result.stderr
    result = invoke("run", str(labels), str(bad), "--min-answered-accuracy", "0.5", "--junit", tmp_path / "j.xml")
    assert result.exit_code == 2 and "--junit and --min-answered-accuracy need a gold field" in result.stderr
    result = invoke("run", str(labels), str(bad), "--gold", "answer")
    assert result.exit_code == 2 and "has gold 'c' (answer), which is not one of the labels" in result.stderr


def test_spec_rules_for_choices_and_calibration(tmp_path):
    from prefixcache.errors import SpecError
    from prefixcache.task.specfile import load_spec

    with pytest.raises(SpecError, match="give 'labels' or 'choices', not both"):
        load_spec(write_spec(tmp_path, choices="choices"))
    with pytest.raises(SpecError, match="'calibrate' applies to label tasks"):
        load_spec(write_spec(tmp_path, labels=None, choices="choices", calibrate=True))
    with pytest.raises(SpecError, match="'threshold' must be a probability"):
        load_spec(write_spec(tmp_path, threshold=1.5))
    spec = load_spec(write_spec(tmp_path, calibrate=True))
    assert spec.content_free == ("N/A", "", "[MASK]")


@pytest.mark.parametrize("score_by", ["text", "letter"])
def test_lettered_layout_scores_equal_a_full_forward(chat_tokenizer, tmp_path, score_by):
    """Options shown as "A. ..." lines through {options}; the letters (MMLU style) or the option
    texts (cloze) scored; either way the cached scores equal one full forward per candidate."""
    examples = [{"text": "Which is a colour?", "choices": ["red", "run"], "label": "A"}]
    spec = make_spec(tmp_path, labels=None, choices="choices", template="Q: {text}\n{options}", score_by=score_by,
                     gold="answer", examples=examples)
    clf = _scorer(spec, chat_tokenizer)
    rows = [dict(q, answer="B" if q["id"] == 1 else q["answer"]) for q in QUESTIONS]  # a gold letter, too
    items = list(read_items(str(_items(tmp_path, rows))))
    records = list(classify(clf, items, Batching(size=2)))
    for item, record in zip(items, records, strict=True):
        prep = clf.task.prepare(item)
        options = item.record["choices"]
        assert "\n".join(f"{'ABCDE'[i]}. {o}" for i, o in enumerate(options)) in prep.enc.text
        assert list(prep.candidates) == (list("ABCDE"[: len(options)]) if score_by == "letter" else options)
        want = score_naive(clf.engine.model, prep.enc.ids, list(prep.candidates.values()))
        assert max(abs(a - b) for a, b in zip(record["logprobs"], want, strict=True)) < TOL
        assert record["label"] == options[record["index"]] and record["scored"] == score_by
        gold = item.record["answer"]
        assert record["correct"] == (record["label"] == (options["ABCDE".index(gold)] if gold == "B" else gold))
    answer_turn = "<|im_start|>assistant\n" + ("A" if score_by == "letter" else "red") + "<|im_end|>"
    assert answer_turn in clf.task.prepare(items[0]).enc.text  # the example answers as the items are scored


def test_score_by_letter_needs_choices(tmp_path):
    from prefixcache.errors import SpecError
    from prefixcache.task.specfile import load_spec

    with pytest.raises(SpecError, match="'score_by: letter' is for multiple choice"):
        load_spec(write_spec(tmp_path, score_by="letter"))
    with pytest.raises(SpecError, match="'score_by' must be text"):
        load_spec(write_spec(tmp_path, labels=None, choices="choices", score_by="number"))
