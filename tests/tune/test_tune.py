"""`prefixcache tune`: every rule's figures are those of `run` with that rule written in the spec;
the cross-validated choice finds a rule known to be better and names no winner where nothing
differs; the tuned spec keeps the user's comments and reproduces the figures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from helpers import TEXTS, invoke, write_spec
from prefixcache.task.decision import judge
from prefixcache.tune.rules import Decided, Gold, Rule
from prefixcache.reports.resampling import cv_splits
from prefixcache.tune.selection import Config, Goal, Search, select
from prefixcache.task.tuned import tuned_text

LABELS3 = ["billing", "technical", "account"]


def _items(tmp_path, n=30, name="items.jsonl", labels=LABELS3, field="gold", start=0):
    path = tmp_path / name
    rows = [{"id": f"i{k}", "text": f"{TEXTS[k % len(TEXTS)]} #{k}", field: labels[(k * 7 + k // 3) % len(labels)]}
            for k in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tune(*args):
    result = invoke("tune", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _run_figures(spec, items, tmp_path, *extra):
    metrics = tmp_path / "metrics.json"
    result = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "--overwrite", "--metrics", metrics, "-q", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(metrics.read_text())


def _with_rule(tmp_path, spec_keys, row, name="rule.yaml"):
    keys = dict(spec_keys, normalize=row["normalize"], calibrate=row["calibrate"])
    if row["threshold"] is not None:
        keys["threshold"] = row["threshold"]
    return write_spec(tmp_path, name=name, **keys)


# -- every rule is `run` with that rule ----------------------------------------------------------
def test_each_rule_equals_run_with_that_rule_written_in_the_spec(tmp_path, tiny_model_dir):
    keys = dict(model=str(tiny_model_dir), labels=LABELS3, examples=[{"text": "refund me", "label": "billing"}])
    spec, items = write_spec(tmp_path, **keys), _items(tmp_path)
    found = _tune(spec, items, "--gold", "gold", "--folds", "3")
    assert len(found["rows"]) == 10 and found["items"] == 30
    for row in found["rows"]:
        figures = _run_figures(_with_rule(tmp_path, keys, row), items, tmp_path, "--gold", "gold")
        assert figures["accuracy"] == row["accuracy"]["value"] == row["as_run"]["accuracy"], row
        assert math.isclose(figures["macro_f1"], row["macro_f1"]["value"], abs_tol=1e-12)
        assert row["accuracy"]["low"] <= row["accuracy"]["value"] <= row["accuracy"]["high"]


def test_multiple_choice_rules_equal_run(tmp_path, tiny_model_dir):
    keys = dict(model=str(tiny_model_dir), labels=None, choices="options", template="Q: {text}")
    spec = write_spec(tmp_path, **keys)
    path = tmp_path / "mc.jsonl"
    opts = [["a refund", "a crash", "a password"], ["yes", "no"], ["the billing team", "technical support", "x", "y"]]
    rows = [{"id": k, "text": TEXTS[k % len(TEXTS)], "options": opts[k % 3], "answer": opts[k % 3][(k * 5) % len(opts[k % 3])]}
            for k in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = _tune(spec, path, "--gold", "answer", "--folds", "3")
    assert [r["calibrate"] for r in found["rows"]] == [False] * 5 and found["rows"][0]["macro_f1"] is None
    for row in found["rows"]:
        figures = _run_figures(_with_rule(tmp_path, keys, row), path, tmp_path, "--gold", "answer")
        assert figures["accuracy"] == row["accuracy"]["value"], row


def test_multi_label_thresholds_are_fitted_and_reproduced_by_run(tmp_path, tiny_model_dir):
    keys = dict(model=str(tiny_model_dir), labels=LABELS3, multi_label=True)
    spec = write_spec(tmp_path, **keys)
    path = tmp_path / "tags.jsonl"
    rows = [{"id": k, "text": TEXTS[k % len(TEXTS)] + f" {k}", "tags": [l for j, l in enumerate(LABELS3) if (k >> j) & 1]}
            for k in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "id": f"h{r['id']}", "text": r["text"] + " again"}) + "\n" for r in rows))
    found = _tune(spec, path, "--gold", "tags", "--test", held, "--metric", "macro-f1")
    assert {(r["calibrate"], r["threshold_fitted"]) for r in found["rows"]} == {(False, False), (True, False),
                                                                                (False, True), (True, True)}
    for row in found["rows"]:  # on the test items, every row's figures are run's with its threshold
        figures = _run_figures(_with_rule(tmp_path, keys, row), held, tmp_path, "--gold", "tags")
        assert figures["accuracy"] == row["accuracy"]["value"]
        assert math.isclose(figures["macro_f1"], row["macro_f1"]["value"], abs_tol=1e-12)


def test_tuned_spec_reproduces_the_held_out_figures(tmp_path, tiny_model_dir):
    keys = dict(model=str(tiny_model_dir), labels=LABELS3, threshold=0.4)
    spec = write_spec(tmp_path, **keys)
    spec.write_text("# my triage spec\n" + spec.read_text().replace("threshold: 0.4", "threshold: 0.4  # abstain below"))
    items, test = _items(tmp_path, 40), _items(tmp_path, 20, "test.jsonl", start=40)
    tuned = tmp_path / "tuned.yaml"
    found = _tune(spec, items, "--gold", "gold", "--test", test, "--min-coverage", "0.5", "-o", tuned)
    text = tuned.read_text()
    assert "# my triage spec" in text and text.startswith("# prefixcache tune")
    figures = _run_figures(tuned, test, tmp_path, "--gold", "gold")
    row = found["pick"] if found["verdict"] == "winner" else found["spec_as_written"]
    assert figures["accuracy"] == row["as_run"]["accuracy"] == row["accuracy"]["value"]
    assert figures["coverage"] == row["coverage"]["value"]


# -- choosing honestly -------------------------------------------------------------------------
def _synthetic(n, seed, better=None, rules=("sum", "mean", "chars", "bytes", "pmi")):
    """Two labels, one a token long and one four tokens long. The gold label's tokens average
    log-prob -0.5 and the other's -1.0, with noise. With `better="mean"`, one set of scores is
    decided by each rule ("mean" divides by the tokens, which is right here; the others stand in
    for rules that sum, biased against the long label). With `better=None`, every rule sums
    scores of its own noise: rules that differ item by item but not in accuracy."""
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 2, n)
    tokens = [1, 4]

    def scores():
        return [[((-0.5 if k == g else -1.0) + rng.normal(0, 0.4)) * tokens[k] for k in range(2)] for g in gold]

    shared = scores()
    table = {}
    for rule in rules:
        how = "mean" if rule == better else "sum"
        decisions = [judge(lps, how, tokens, ["a", "bbbb"]) for lps in (shared if better else scores())]
        table[(0, Rule(rule))] = Decided(np.array([d.best for d in decisions]),
                                         np.array([d.probs[d.best] for d in decisions]))
    return Gold(("a", "bbbb"), gold), table


def _select(gold, table, folds=5, seed=0):
    configs = [Config(0, rule) for _, rule in table]
    search = Search(table, gold, Goal(), configs, configs[0])
    return select(search, cv_splits(gold.strata(), folds, seed), np.arange(len(gold.index)), seed)


def test_cross_validation_picks_the_rule_known_to_be_better():
    gold, table = _synthetic(200, seed=1, better="mean")
    selection = _select(gold, table)
    assert selection.pick.config.rule == Rule("mean") and selection.verdict == "winner"
    assert selection.gain.low > 0 and selection.pick.picked == 5
    assert selection.tuned["accuracy"].value == selection.pick.figures["accuracy"].value  # chosen in every fold


def test_no_winner_when_the_rules_do_not_differ():
    verdicts = [_select(*_synthetic(80, seed)).verdict for seed in range(30)]
    assert verdicts.count("winner") <= 1, verdicts  # equal rules: a false winner is rare, not the rule
    assert _select(*_synthetic(80, 0)).verdict in ("no winner", "spec")


def test_cross_validation_folds_partition_the_items_and_keep_label_shares():
    strata = ["a"] * 30 + ["b"] * 10
    splits = cv_splits(strata, 5, seed=3)
    held = np.concatenate([h for _, h in splits])
    assert sorted(held) == list(range(40))
    for fit, h in splits:
        assert set(fit).isdisjoint(h) and len(fit) + len(h) == 40
        assert sum(strata[i] == "b" for i in h) == 2


# -- the tuned spec ----------------------------------------------------------------------------
def test_tuned_text_keeps_comments_and_sets_keys():
    original = ("# ticket triage\nsystem: |\n  Route tickets.\n  # a line of the prompt\n\n# the labels\nlabels: [a, b]\n"
                "normalize: sum  # per whole label\ncalibrate: true\n")
    text = tuned_text(original, {"normalize": "mean", "system": "Be terse.", "threshold": 0.35}, "chosen by tune")
    data = yaml.safe_load(text)
    assert data == {"system": "Be terse.", "labels": ["a", "b"], "normalize": "mean", "calibrate": True, "threshold": 0.35}
    assert text.startswith("# chosen by tune\n# ticket triage\n# set by prefixcache tune\nsystem: Be terse.\n")
    assert "# the labels\nlabels: [a, b]" in text and "normalize: mean  # tuned, was: sum  # per whole label" in text
    assert "calibrate: true\n" in text and text.endswith("# chosen by prefixcache tune\nthreshold: 0.35\n")
    assert tuned_text(original, {"normalize": "sum", "calibrate": True}) == original  # unchanged keys: untouched


@pytest.mark.parametrize("original, keys", [
    ('"normalize": mean\nlabels: [a, b]\n', {"normalize": "sum"}),  # a quoted key the line editor does not follow
    ("labels: [a, b]\nsystem: old\n", {"system": "Be terse.\x85Very."}),  # YAML 1.1 reads U+0085 as a line break
])
def test_a_tuned_spec_reads_back_as_the_spec_that_was_scored(tmp_path, original, keys):
    from prefixcache.task.specfile import read_spec_file
    from prefixcache.task.tuned import write_tuned

    spec = tmp_path / "spec.yaml"
    spec.write_text(original, encoding="utf-8")
    write_tuned(tmp_path / "tuned.yaml", read_spec_file(spec), keys, "chosen by tune")
    assert dict(read_spec_file(tmp_path / "tuned.yaml").data) == {**read_spec_file(spec).data, **keys}


def test_tuned_text_replaces_block_values():
    original = "examples:\n  - text: a\n    label: x\n  - text: b\n    label: y\ntemplate: '{text}'  # the item\n"
    text = tuned_text(original, {"examples": [{"text": "c", "label": "x"}], "template": "{text}"})
    assert yaml.safe_load(text) == {"examples": [{"text": "c", "label": "x"}], "template": "{text}"}
    assert "template: '{text}'  # the item" in text and text.startswith("# set by prefixcache tune\nexamples:\n")


# -- variants and refusals ---------------------------------------------------------------------
def test_variants_from_a_file_and_the_command_line(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3)
    variants = tmp_path / "variants.yaml"
    variants.write_text("- name: terse\n  system: Reply with the category.\n- name: described\n"
                        "  labels: {billing: money, technical: bugs, account: sign-in}\n")
    (tmp_path / "system.txt").write_text("You sort tickets.")
    examples = tmp_path / "examples.jsonl"
    examples.write_text(json.dumps({"text": "my card was charged", "label": "billing"}) + "\n")
    found = _tune(spec, _items(tmp_path), "--gold", "gold", "--variants", variants, "--system", "@" + str(tmp_path / "system.txt"),
                  "--examples", examples)
    names = [v["name"] for v in found["variants"]]
    assert names == ["as written", "terse", "described", "examples 1", "system 1", "system 1 + examples 1"]
    assert len(found["rows"]) == 60 and all(v["prefix_tokens"] > 0 for v in found["variants"])


@pytest.mark.parametrize("args, message", [
    ((), "name the field with --gold"),
    (("--gold", "gold", "--metric", "f1"), "--metric"),
    (("--gold", "gold", "--limit", "6"), "too few to choose by 5-fold"),
    (("--gold", "nope"), "lacks the gold field 'nope'"),
    (("--gold", "gold", "--variants", "VARIANTS"), "sets 'normalize', which tune searches itself"),
    (("--gold", "gold", "--variants", "RENAMED"), "not the spec's"),
    (("--gold", "gold", "-o", "SPEC"), "is the spec itself"),
    (("--gold", "gold", "--test", "ITEMS"), "is LABELLED itself"),
    (("--gold", "gold", "--test", "OVERLAP"), "12 of its 20 items are also in"),
    (("--gold", "gold", "--variants", "TWINS"), "is named 'terse' like another"),
    (("--gold", "one"), "every labelled item has the gold 'billing' (one)"),
])
def test_tune_refuses_before_loading_a_model(tmp_path, args, message):
    spec = write_spec(tmp_path, model=str(tmp_path / "no-model-here"), labels=LABELS3)
    (tmp_path / "v.yaml").write_text("- normalize: mean\n")
    (tmp_path / "r.yaml").write_text("- labels: [billing, tech, account]\n")
    (tmp_path / "t.yaml").write_text("- {name: terse, system: a}\n- {name: terse, system: b}\n")
    overlap = _items(tmp_path, 20, name="test.jsonl", start=18)
    if "one" in args:
        _items(tmp_path, labels=["billing"], field="one")
    files = {"VARIANTS": tmp_path / "v.yaml", "RENAMED": tmp_path / "r.yaml", "SPEC": spec, "TWINS": tmp_path / "t.yaml",
             "ITEMS": tmp_path / "items.jsonl", "OVERLAP": overlap}
    args = [str(files.get(a, a)) for a in args]
    items = tmp_path / "items.jsonl" if (tmp_path / "items.jsonl").exists() else _items(tmp_path)
    result = invoke("tune", spec, items, *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_markdown_and_table(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3)
    md = tmp_path / "summary.md"
    result = invoke("tune", spec, _items(tmp_path), "--gold", "gold", "--md", md, "--top", "3", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "5-fold cross-validation over 30 items" in result.stdout and "chosen in" in result.stdout
    assert ("no winner" in result.stdout or "pick:" in result.stdout or "keep the spec" in result.stdout)
    text = md.read_text()
    assert text.startswith("### prefixcache tune") and "| # | prompt | rule |" in text
    assert sum(line.startswith("| ") for line in text.splitlines()) - 1 in (3, 4, 5)  # top 3, spec and pick kept


def test_a_tuned_spec_written_elsewhere_keeps_finding_its_model(tmp_path, tiny_model_dir):
    import shutil

    home = tmp_path / "project"
    shutil.copytree(tiny_model_dir, home / "models" / "tiny")
    spec = write_spec(home, model="models/tiny", labels=LABELS3)
    elsewhere = tmp_path / "out"
    elsewhere.mkdir()
    _tune(spec, _items(tmp_path), "--gold", "gold", "-o", elsewhere / "tuned.yaml")
    assert yaml.safe_load((elsewhere / "tuned.yaml").read_text())["model"] == str((home / "models" / "tiny").resolve())
    result = invoke("run", elsewhere / "tuned.yaml", _items(tmp_path), "-q")
    assert result.exit_code == 0, result.output


def test_a_spec_from_a_pipe_is_read_once(tmp_path, tiny_model_dir):
    import os
    import threading

    text = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS3).read_text()
    fifo = tmp_path / "spec-pipe"
    os.mkfifo(fifo)
    threading.Thread(target=fifo.write_text, args=(text,), daemon=True).start()  # one reader gets it, once
    tuned = tmp_path / "tuned.yaml"
    found = _tune(fifo, _items(tmp_path), "--gold", "gold", "--system", "Route tickets.", "-o", tuned)
    assert [v["name"] for v in found["variants"]] == ["as written", "system 1"]
    assert yaml.safe_load(tuned.read_text())["labels"] == LABELS3  # written from the one read of the pipe
