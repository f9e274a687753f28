"""Multi-label tagging and verbalizers: every label's probability equals a naive full forward of
the whole prompt per (item, label), built here from the chat template or the plain layout by hand."""

from __future__ import annotations

import json
import math

import pytest
from helpers import TEXTS, make_spec, naive_scores, naive_yes_logprob, text_items, tiny_scorer

from prefixcache.run.pipeline import classify
from prefixcache.scoring.prepare import Batching

TOL = 1e-4
TAGS = ["billing", "technical", "account access", "refund"]
TAG_EXAMPLES = [
    {"text": "I was charged twice, please refund.", "labels": ["billing", "refund"]},
    {"text": "The app crashes when I open a project.", "labels": ["technical"]},
    {"text": "Hello there", "labels": []},
]
SYSTEM = "You are a support ticket router."




@pytest.mark.parametrize("mode", ["chat", "plain"])
def test_tag_probabilities_equal_a_full_forward_per_label(mode, chat_tokenizer, plain_tokenizer, tmp_path):
    from conftest import tiny_model

    tokenizer = chat_tokenizer if mode == "chat" else plain_tokenizer
    model = tiny_model("llama", len(tokenizer))
    spec = make_spec(tmp_path, labels=TAGS, multi_label=True, examples=TAG_EXAMPLES, system=SYSTEM)
    texts = TEXTS[:6]
    got = list(classify(tiny_scorer(spec, tokenizer, model), text_items(texts), Batching(size=4)))
    worst, spread = 0.0, []
    for record, text in zip(got, texts, strict=True):
        for label in TAGS:
            want = naive_yes_logprob(model, tokenizer, spec, {"text": text}, label)
            worst = max(worst, abs(record["logprobs"][label] - want), abs(record["probs"][label] - math.exp(want)))
            spread.append(want)
        assert record["labels"] == [lab for lab in TAGS if record["probs"][lab] >= 0.5]
    assert worst < TOL
    assert max(spread) - min(spread) > 100 * TOL  # the check can fail: labels and items differ


def test_verbalizer_scores_equal_the_summed_probability_of_the_forms(chat_tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model("qwen2", len(chat_tokenizer))
    labels = {"billing": {"words": ["billing", "payment", "invoice"]}, "technical": {"words": ["tech", "technical"]},
              "account": "sign-in problems"}
    spec = make_spec(tmp_path, labels=labels)
    scorer = tiny_scorer(spec, chat_tokenizer, model)
    builder = scorer.task.builder
    for record, text in zip(classify(scorer, text_items(TEXTS[:5]), Batching(size=3)), TEXTS[:5], strict=True):
        ids = builder.encode_item({"text": text}).ids
        want = {}
        for name, forms in (("billing", ["billing", "payment", "invoice"]), ("technical", ["tech", "technical"]),
                            ("account", ["account"])):
            lps = naive_scores(model, ids, [builder.candidate_ids(f) for f in forms])
            want[name] = math.log(sum(math.exp(lp) for lp in lps))
        assert max(abs(record["logprobs"][n] - want[n]) for n in want) < TOL
        total = sum(math.exp(v) for v in want.values())
        assert max(abs(record["probs"][n] - math.exp(want[n]) / total) for n in want) < TOL


# -- the spec ----------------------------------------------------------------------------------
@pytest.mark.parametrize("keys, message", [
    (dict(multi_label=True, choices="options", labels=None), "'multi_label' applies to label tasks"),
    (dict(multi_label=True, labels={"a": {"words": ["a", "b"]}, "c": None}), "'words', which apply to tasks that pick one"),
    (dict(multi_label=True, normalize="mean"), "normalize must be sum"),
    (dict(multi_label=True, question="Is it?"), "'question' must name the label"),
    (dict(multi_label=True, answers=["yes", "yes"]), "'answers' must be two different words"),
    (dict(multi_label=True, threshold={"nope": 0.3}), "'threshold' names 'nope'"),
    (dict(threshold={"tech": 0.3}), "a 'threshold' per label applies to multi_label"),
    (dict(question="Is it {label}?"), "'question' applies to multi_label tasks"),
    (dict(multi_label=True, examples=[{"text": "x", "labels": ["nope"]}]), "example 1 has label 'nope'"),
    (dict(multi_label=True, examples=[{"text": "x", "labels": 3}]), "example 1 needs 'labels'"),
    (dict(labels={"a": {"words": []}}), "'words' of label 'a' must be a non-empty list"),
    (dict(labels={"a": {"words": ["x", "x"]}}), "lists 'x' twice"),
    (dict(labels={"a": {"wrods": ["x"]}}), "unknown key 'wrods'"),
])
def test_spec_refuses_what_cannot_be_tagged(tmp_path, keys, message):
    from prefixcache.errors import SpecError

    with pytest.raises(SpecError, match=message):
        make_spec(tmp_path, **keys)


def test_spec_tag_keys_and_defaults(tmp_path):
    spec = make_spec(tmp_path, labels=TAGS, multi_label=True, threshold={"refund": 0.8})
    assert spec.tag_thresholds == (0.5, 0.5, 0.5, 0.8) and spec.threshold is None
    unset = make_spec(tmp_path, labels=TAGS, multi_label=True, threshold={"refund": None})  # `refund:` left empty
    assert unset.tag_thresholds == (0.5,) * 4
    assert spec.answers == ("yes", "no") and spec.question_for(spec.labels[0]) == "Is this about billing?"
    worded = make_spec(tmp_path, labels={"billing": {"words": ["billing", "invoice"], "description": "money"}, "x": None})
    assert worded.labels[0].forms == ("billing", "invoice") and worded.labels[0].description == "money"
    assert worded.labels[1].forms == ("x",)


@pytest.mark.parametrize("value, sep, want", [
    (["refund", "billing"], ",", ["billing", "refund"]),
    ('["technical"]', ",", ["technical"]),
    ("billing, refund", ",", ["billing", "refund"]),
    ("billing|account access", "|", ["billing", "account access"]),
    ("", ",", []),
    ([], ",", []),
])
def test_gold_tags_read_lists_json_and_separated_strings(value, sep, want):
    from prefixcache.task.spec import gold_tags

    assert gold_tags({"g": value}, "g", TAGS, sep) == want


@pytest.mark.parametrize("value, message", [
    ("billing|nope", "gold label 'billing|nope'"),
    (["nope"], "gold label 'nope'"),
    ({"a": 1}, "not a list of labels"),
    (3, "not a list of labels"),
    ("[unclosed", "neither a JSON list"),
    (None, "lacks the gold field"),
])
def test_gold_tags_refuse_bad_values(value, message):
    from prefixcache.task.spec import gold_tags

    with pytest.raises(ValueError, match=message):
        gold_tags({"g": value}, "g", TAGS, ",")


# -- metrics against scikit-learn -------------------------------------------------------------
def test_tag_metrics_equal_scikit_learn():
    import random

    from sklearn.metrics import accuracy_score, classification_report, hamming_loss, precision_recall_fscore_support

    from prefixcache.reports.evaluation import evaluate

    rng = random.Random(3)
    records = []
    for i in range(200):
        gold = [t for t in TAGS if rng.random() < 0.35]
        pred = [t for t in TAGS if (t in gold) != (rng.random() < 0.25)]
        records.append({"id": i, "labels": pred, "gold": gold, "probs": {t: rng.random() for t in TAGS}})
    ev = evaluate(TAGS, records, tags=True)
    y = [[t in r["gold"] for t in TAGS] for r in records]
    p = [[t in r["labels"] for t in TAGS] for r in records]
    report = classification_report(y, p, target_names=TAGS, output_dict=True, zero_division=0)
    for t in TAGS:
        for k in ("precision", "recall", "f1-score"):
            assert ev.per_label()[t][k.replace("-score", "")] == pytest.approx(report[t][k], abs=1e-12)
        assert ev.per_label()[t]["support"] == report[t]["support"]
    for avg in ("micro", "macro"):
        want = precision_recall_fscore_support(y, p, average=avg, zero_division=0)[:3]
        assert getattr(ev, avg)() == pytest.approx(want, abs=1e-12)
    assert ev.hamming_loss == pytest.approx(hamming_loss(y, p), abs=1e-12)
    assert ev.accuracy == pytest.approx(accuracy_score(y, p), abs=1e-12)  # exact-set (subset) accuracy
    assert 0 < ev.accuracy < 1 and 0 < ev.hamming_loss < 1


def test_tag_gates_and_reports_name_the_metric():
    from prefixcache.reports.evaluation import Gates, evaluate

    records = [{"id": 1, "labels": ["billing"], "gold": ["billing"]}, {"id": 2, "labels": [], "gold": ["refund"]},
               {"id": 3, "error": "x"}]
    ev = evaluate(TAGS, records, tags=True)
    assert (ev.n, ev.correct, ev.failed) == (3, 1, 1)
    assert ev.hamming_loss == pytest.approx(1 / 8)
    failures = ev.gate_failures(Gates(min_accuracy=0.5, min_recall=0.5))
    assert failures[0] == "exact-set accuracy 0.3333 is below --min-accuracy 0.5"
    assert any("recall of 'refund' 0.0000" in f for f in failures)
    assert "exact-set accuracy 0.333" in ev.to_markdown(Gates()) and "| refund |" in ev.to_markdown(Gates())
    assert 'name="recall[refund]"' in ev.to_junit(Gates(min_recall=0.5))


# -- the command line -------------------------------------------------------------------------
GOLD = ["billing", "technical", "", "account access", "billing|refund", "technical|account access", "refund", ""]


@pytest.fixture()
def tag_run(tmp_path, tiny_model_dir):
    """A multi-label spec on the tiny model and 8 items with gold tags separated by '|'."""
    from helpers import write_spec

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=TAGS, multi_label=True, examples=TAG_EXAMPLES,
                      gold="tags", gold_sep="|", calibrate=True, threshold={"refund": 0.9})
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": f"t{i}", "text": TEXTS[i], "tags": g}) + "\n" for i, g in enumerate(GOLD)))
    return spec, items


def test_tag_records_in_jsonl_and_csv(tag_run, tmp_path):
    from helpers import invoke, records

    spec, items = tag_run
    result = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "-b", 3, "--metrics", tmp_path / "m.json")
    assert result.exit_code == 0, result.stderr
    got = records(tmp_path / "out.jsonl")
    first = got[0]
    assert list(first) == ["id", "labels", "probs", "logprobs", "raw_probs", "gold", "correct", "normalize",
                           "prefix_tokens", "item_tokens", "item_sha"]
    assert first["gold"] == ["billing"] and first["normalize"] == "sum+calibrated"
    for r in got:
        want = [t for t in TAGS if r["probs"][t] >= (0.9 if t == "refund" else 0.5)]
        assert r["labels"] == want and r["correct"] == (r["labels"] == r["gold"])
    assert "exact-set accuracy" in result.stderr and "Hamming loss" in result.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["accuracy_is"] == "exact-set" and set(metrics["per_label"]) == set(TAGS)

    assert invoke("run", spec, items, "-o", tmp_path / "out.csv", "-b", 3).exit_code == 0
    header = (tmp_path / "out.csv").read_text().splitlines()[0].split(",")
    assert header[:6] == ["id", "labels", "prob_billing", "prob_technical", "prob_account access", "prob_refund"]
    from prefixcache.data.output import read_records

    back = [{k: v for k, v in r.items() if k != "ms"} for r in read_records(str(tmp_path / "out.csv")).records]
    assert [{**r, "id": str(r["id"])} for r in got] == back  # the CSV reads back as the JSONL


def test_bad_tag_gold_is_refused_with_file_and_line(tag_run, tmp_path):
    from helpers import invoke

    spec, items = tag_run
    lines = items.read_text().splitlines()
    lines[2] = json.dumps({"id": "t2", "text": "x", "tags": "billing|nope"})
    items.write_text("\n".join(lines) + "\n")
    result = invoke("run", spec, items, "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (f"error: {items}:3: item 't2' has gold label 'nope' (tags), "
                                              f"which is not one of the labels")
    assert invoke("run", spec, items, "--gold-sep", ",", "-o", tmp_path / "o2.jsonl").exit_code == 2


def test_tags_resume_shards_merge_update_and_keep_give_the_full_run(tag_run, tmp_path):
    from helpers import invoke, records

    spec, items = tag_run
    full = tmp_path / "full.jsonl"
    assert invoke("run", spec, items, "-o", full, "-b", 2).exit_code == 0
    part = tmp_path / "part.jsonl"
    assert invoke("run", spec, items, "-o", part, "-b", 2, "--limit", 4).exit_code == 0
    assert invoke("run", spec, items, "-o", part, "-b", 2, "--resume").exit_code == 0
    assert records(part) == records(full)
    shards = [tmp_path / f"s{k}.jsonl" for k in (1, 2)]
    for k, path in enumerate(shards, 1):
        assert invoke("run", spec, items, "-o", path, "-b", 2, "--shard", f"{k}/2").exit_code == 0
    assert invoke("merge", *shards, "-o", tmp_path / "merged.jsonl").exit_code == 0
    assert records(tmp_path / "merged.jsonl") == records(full)
    kept = tmp_path / "kept.csv"
    assert invoke("run", spec, items, "-o", kept, "-b", 2, "--keep", "text").exit_code == 0
    assert invoke("run", spec, items, "-o", kept, "-b", 2, "--keep", "text", "--update").exit_code == 0
    assert kept.read_text().splitlines()[0].startswith("id,text,labels,prob_billing")


def test_tags_exact_rescores_close_calls_in_float32(tag_run, tmp_path, monkeypatch):
    from helpers import invoke, records

    from prefixcache.scoring import exact as exact_mode

    spec, items = tag_run
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))  # its bounds are this test's alone
    assert invoke("run", spec, items, "-o", tmp_path / "f32.jsonl").exit_code == 0
    result = invoke("run", spec, items, "-o", tmp_path / "ex.jsonl", "--dtype", "bfloat16", "--exact")
    assert result.exit_code == 0, result.stderr
    exact, want = records(tmp_path / "ex.jsonl"), records(tmp_path / "f32.jsonl")
    assert [r["labels"] for r in exact] == [r["labels"] for r in want]
    assert {r["precision"] for r in exact} <= {"float32", "bfloat16"}
    monkeypatch.setattr(exact_mode, "FLOOR", 1e9)  # every tag's call is close: each record a float32 one
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache-wide"))
    result = invoke("run", spec, items, "-o", tmp_path / "all.jsonl", "--dtype", "bfloat16", "--exact")
    assert result.exit_code == 0, result.stderr
    rescored = records(tmp_path / "all.jsonl")
    assert {r["precision"] for r in rescored} == {"float32"}
    assert [r["labels"] for r in rescored] == [r["labels"] for r in want]


def test_tag_diff_shows_flips_and_mcnemar_per_label(tmp_path):
    from helpers import invoke, write_records

    a = [{"id": i, "labels": ["billing"] if i < 6 else [], "probs": {"billing": 0.9 if i < 6 else 0.1, "refund": 0.2},
          "gold": ["billing"], "correct": i < 6} for i in range(10)]
    b = [{**r, "labels": ["billing"], "probs": {"billing": 0.8, "refund": 0.2}, "correct": True} for r in a]
    write_records(tmp_path / "a.jsonl", a)
    write_records(tmp_path / "b.jsonl", b)
    result = invoke("diff", tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--json", tmp_path / "d.json")
    assert result.exit_code == 0, result.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["per_label"]["billing"] == {"turned_on": 4, "turned_off": 0, "fixed": 4, "broken": 0,
                                            "mcnemar_p": 0.125}
    assert data["per_label"]["refund"]["turned_on"] == 0 and data["changed"] == 4


def test_verbalizer_lint_warns_about_shared_and_prefix_forms(chat_tokenizer, tmp_path):
    from prefixcache.task.lint import lint_labels
    from prefixcache.task.prompt import PromptBuilder

    spec = make_spec(tmp_path, labels={"money": {"words": ["bill", "refund"]}, "tech": {"words": ["technical", "refund"]},
                                       "billing": None})
    warnings = lint_labels(PromptBuilder(spec, chat_tokenizer))
    assert "form 'refund' belongs to labels 'money', 'tech': its probability counts for each" in warnings
    assert any(w.startswith("form 'bill' of label 'money' (bill) is a token-prefix of 'billing'") for w in warnings)


def test_render_shows_each_label_with_its_candidates(tag_run, tmp_path):
    from helpers import invoke

    spec, items = tag_run
    result = invoke("render", spec, items, "--limit", 1, "--text")
    assert result.exit_code == 0
    assert "'refund': 'Is this about refund?<|im_end|>\\n<|im_start|>assistant\\nyes<|im_end|>' | " in result.stdout
    rendered = json.loads(invoke("render", spec, items, "--limit", 1).stdout)
    assert rendered["prompt"].endswith("Ticket: The app crashes when I open a project.\n")
    assert len(rendered["labels"]["billing"]) == 2


def test_tag_report_has_per_label_tables_and_calibration(tmp_path):
    pytest.importorskip("matplotlib")
    from helpers import write_records

    from prefixcache.reports.htmlpage import build_report

    records = [{"id": i, "labels": ["billing"] if i % 2 else [], "probs": {"billing": 0.1 + 0.08 * i, "refund": 0.3},
                "gold": ["billing"] if i % 3 else ["refund"], "correct": False, "normalize": "sum"} for i in range(10)]
    for r in records:
        r["correct"] = r["labels"] == r["gold"]
    write_records(tmp_path / "o.jsonl", records)
    page = build_report(str(tmp_path / "o.jsonl"))
    assert "exact-set accuracy" in page and "Hamming loss" in page and "<h2>per label</h2>" in page
    assert "billing · ECE" in page and "refund · ECE" in page  # a reliability diagram per label
    assert "<h2>label set wrong</h2>" in page


@pytest.mark.parametrize("threshold, words", [(0.999999, "got no tag"), (1e-12, "got every tag (all 3)")])
def test_tags_piled_on_none_or_all_are_warned_about(tmp_path, tiny_model_dir, threshold, words):
    import json

    from helpers import invoke, write_spec

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["billing", "technical", "account"],
                      multi_label=True, threshold=threshold)
    items = tmp_path / "i.jsonl"
    items.write_text("".join(json.dumps({"id": n, "text": f"ticket {n}"}) + "\n" for n in range(24)))
    result = invoke("run", spec, items, "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 0 and f"100% of the items (24 of 24) {words}" in result.stderr, result.stderr
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"id": n, "text": f"ticket {n}"}) + "\n" for n in range(5)))
    assert words not in invoke("run", spec, few, "-o", tmp_path / "f.jsonl").stderr  # too few to tell
