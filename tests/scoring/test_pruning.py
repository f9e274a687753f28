"""Pruned label scoring: the items run once, then only the branches still in the race; the
argmax, abstention and the winner's score equal full scoring on every item."""

from __future__ import annotations

import random

import pytest
from helpers import TEXTS, make_spec, text_items, tiny_scorer

from prefixcache.model.engine import Engine
from prefixcache.model.rows import Row
from prefixcache.task.prompt import PromptBuilder

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("races_of_any_size")  # small label sets race too (see the last test)


def _close(a: float, b: float) -> bool:
    """Equal up to float32 summation order (log-probs of a peaked model reach -100)."""
    return abs(a - b) < TOL + 2e-6 * abs(b)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_branches_after_kept_items_equal_full_scoring(arch, chat_tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model(arch, len(chat_tokenizer))
    builder = PromptBuilder(make_spec(tmp_path, labels=["tech", "technical", "bill", "billing", "account access", "x"]),
                            chat_tokenizer)
    engine = Engine(model)
    assert engine.branches
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:7]]
    rows = [Row(e.ids, e.prefix_len, cands) for e in encoded]
    nodes = sorted({c[:k] for c in cands for k in range(1, len(c) + 1)})
    summed = [dict(zip(nodes, lps, strict=True)) for lps in engine.score(prefix, [Row(r.ids, r.prefix_len, nodes) for r in rows])]
    [opened] = engine.open_items(prefix, rows)  # one group on this engine
    for b in range(len(rows)):  # the first tokens come with the items
        assert all(abs(v - summed[b][node]) < TOL for node, v in opened.firsts(b).items())
    rng = random.Random(0)
    ends = sorted({c[:-1] for c in cands if len(c) > 1})
    for step in range(3):  # nodes fed over several passes: none is ever run twice
        chosen = {b: rng.sample(ends, rng.randint(1, len(ends))) for b in range(len(rows)) if b != step}
        new = sum(len({n[:k] for n in ns for k in range(1, len(n) + 1)} - opened.fed[b].keys()) for b, ns in chosen.items())
        before = engine.label_tokens
        got = opened.feed(chosen)
        assert engine.label_tokens - before == new  # exactly the nodes not fed before, each once
        assert new > 0 or step  # the first pass feeds some (later ones may find all fed)
        for b, found in got.items():
            assert found
            for child, value in found.items():  # a token's log-prob: the difference of full scoring's sums
                assert abs(value - (summed[b][child] - summed[b].get(child[:-1], 0.0))) < TOL, (b, child)



def _planted(arch, tokenizer, **kw):
    """A peaked tiny model whose chat answers end surely after their words (see conftest.planted)."""
    from conftest import planted, tiny_model

    return planted(tiny_model(arch, len(tokenizer), **kw), tokenizer.convert_tokens_to_ids("<|im_end|>"))



def _compare(spec, tokenizer, model, texts, batch=4, mode="exact"):
    """Records of pruned and full scoring of the same items; checks what pruning promises."""
    from prefixcache.run.pipeline import classify
    from prefixcache.scoring.prepare import Batching

    full, pruned = tiny_scorer(spec, tokenizer, model), tiny_scorer(spec, tokenizer, model)
    assert pruned.prune(mode) and not full.pruning
    want = list(classify(full, text_items(texts), Batching(size=batch)))
    got = list(classify(pruned, text_items(texts), Batching(size=batch)))
    for w, g in zip(want, got, strict=True):
        assert g["label"] == w["label"], (g["id"], g["label"], w["label"])  # abstention too (label None)
        for field in ("probs", "raw_probs"):
            for k, v in w.get(field, {}).items():
                if mode == "exact":  # every reported probability is full scoring's
                    assert abs(g[field][k] - v) < 1e-4, (field, k)
                elif k not in g["pruned"]:  # with the labels left at their bounds: a lower bound
                    assert g[field][k] <= v + 1e-5, (field, k)  # records keep 6 decimals
        if w["label"] is not None:
            assert _close(g["logprobs"][w["label"]], w["logprobs"][w["label"]])  # the winner's score is exact
        for name, lp in g["logprobs"].items():
            if name in g["pruned"]:
                assert lp >= w["logprobs"][name] - TOL  # a bound from above
            else:
                assert _close(lp, w["logprobs"][name])
    return want, got, pruned, full


WORDS = ("tech technical bill billing billed account access refund invoice payment crash error slow login password "
         "screen update app x y z a b").split()


@pytest.mark.parametrize("mode", ["on", "exact"])
@pytest.mark.parametrize("count", [2, 7, 40, 200])
def test_pruned_argmax_equals_full_scoring(count, mode, chat_tokenizer, tmp_path):

    rng = random.Random(count)
    names = set()
    singles = iter(rng.sample(WORDS, len(WORDS)))
    while len(names) < count:  # shared first tokens, labels that are prefixes of others, one-token labels
        single = next(singles, None) if rng.random() < 0.2 else None
        names.add(single or " ".join(rng.sample(WORDS, rng.randint(1, 3))))
    spec = make_spec(tmp_path, labels=sorted(names))
    # peaked: first tokens tell labels apart; long enough for a prefix listing 200 labels
    model = _planted("llama", chat_tokenizer, seed=count, init=1.0, positions=4096)
    want, got, pruned, full = _compare(spec, chat_tokenizer, model, TEXTS, mode=mode)
    if count >= 40:  # with many labels some fall out: the comparison above saw labels left at their bounds
        assert any(g["pruned"] for g in got)
        assert pruned.engine.label_tokens < full.engine.label_tokens  # and pruning fed fewer label tokens


@pytest.mark.parametrize("keys", [dict(normalize="mean"), dict(normalize="chars"), dict(normalize="bytes"),
                                  dict(normalize="pmi"), dict(calibrate=True), dict(threshold=0.2),
                                  dict(calibrate=True, threshold=0.05, normalize="mean")])
@pytest.mark.parametrize("mode", ["on", "exact"])
def test_pruning_is_exact_under_every_decision_rule(keys, mode, chat_tokenizer, tmp_path, monkeypatch):
    from prefixcache.scoring import pruning

    monkeypatch.setattr(pruning, "DEEPEN", 100)  # races as deep as the labels: more of them left at a bound

    # three-word labels: a fed node reveals all its children, so labels need depth to stay at a bound
    labels = list(WORDS[:8]) + [f"{w} {v} {u}" for w in WORDS[:8] for v, u in zip(WORDS[8:13], WORDS[13:18], strict=True)]
    spec = make_spec(tmp_path, labels=labels, **keys)
    model = _planted("qwen2", chat_tokenizer, seed=5, init=1.0)  # peaked and planted: labels fall out at a bound
    want, got, pruned, full = _compare(spec, chat_tokenizer, model, TEXTS, mode=mode)
    if keys.get("normalize") != "mean":  # per-token means are too close for a label to be negligible here
        assert any(g["pruned"] for g in got)  # the rule was exercised on labels left at a bound


@pytest.mark.parametrize("mode", ["on", "exact"])
def test_an_items_race_is_its_own_whatever_its_batch(mode, chat_tokenizer, tmp_path):

    from prefixcache.run.pipeline import classify
    from prefixcache.scoring.prepare import Batching

    rng = random.Random(40)
    labels = sorted({" ".join(rng.sample(WORDS, rng.randint(1, 3))) for _ in range(60)})[:40]
    spec = make_spec(tmp_path, labels=labels)
    model = _planted("llama", chat_tokenizer, seed=40, init=1.0, positions=4096)
    want, got, pruned, full = _compare(spec, chat_tokenizer, model, TEXTS, batch=len(TEXTS), mode=mode)
    alone = tiny_scorer(spec, chat_tokenizer, model)
    assert alone.prune(mode)
    one_by_one = list(classify(alone, text_items(TEXTS), Batching(size=1)))
    assert sum(len(g["pruned"]) for g in got) > len(TEXTS) * len(labels) / 2  # most labels left at a bound
    for a, g in zip(one_by_one, got, strict=True):  # the same labels pruned, the same bounds
        assert a["pruned"] == g["pruned"] and a["label"] == g["label"]
        assert all(_close(a["logprobs"][k], v) for k, v in g["logprobs"].items())
    assert alone.engine.label_tokens == pruned.engine.label_tokens < full.engine.label_tokens / 2


def test_property_random_label_sets_and_items_find_no_difference(chat_tokenizer, plain_tokenizer, tmp_path):
    from conftest import tiny_model

    from prefixcache.errors import SpecError

    rng = random.Random(11)
    compared = refused = 0
    for trial in range(10):
        tokenizer = chat_tokenizer if trial % 2 else plain_tokenizer
        names = sorted({"".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 9))).strip() or "a"
                        for _ in range(rng.randint(2, 60))})
        texts = ["".join(rng.choice("abcdefghij .,") for _ in range(rng.randint(1, 40))) or "x" for _ in range(6)]
        try:
            spec = make_spec(tmp_path, labels=names, normalize=rng.choice(["sum", "mean", "chars", "pmi"]))
            PromptBuilder(spec, tokenizer)
        except SpecError:  # a label set the spec or tokenizer cannot tell apart: refused as in full scoring
            refused += 1
            continue
        model = tiny_model("llama", len(tokenizer), seed=trial, init=rng.choice([0.2, 1.0]), positions=2048)
        _compare(spec, tokenizer, model, texts, batch=rng.randint(1, 6), mode=rng.choice(["on", "exact"]))
        compared += 1
    assert compared + refused == 10 and compared >= 6, (compared, refused)  # most trials compared something


def test_cli_prunes_on_asking_and_says_which_labels_are_bounds(tmp_path, tiny_model_dir):
    import json

    from helpers import invoke, records, write_spec

    from prefixcache.data.output import read_records

    labels = [f"{w} {v}" for w in WORDS[:6] for v in WORDS[6:11]]  # 30 labels
    shots = [{"text": "refund me", "label": labels[0]}, {"text": "it crashed", "label": labels[7]}]
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=labels, examples=shots)
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    on, exact, auto = tmp_path / "on.jsonl", tmp_path / "exact.jsonl", tmp_path / "auto.jsonl"
    assert invoke("run", spec, items, "-o", on, "-b", 4, "--prune", "on").exit_code == 0
    assert invoke("run", spec, items, "-o", exact, "-b", 4, "--prune", "exact").exit_code == 0
    assert invoke("run", spec, items, "-o", auto, "-b", 4).exit_code == 0  # auto: every label scored
    pruned, precise, full = records(on), records(exact), records(auto)
    assert all("pruned" in r for r in pruned + precise) and not any("pruned" in r for r in full)
    assert [r["label"] for r in pruned] == [r["label"] for r in precise] == [r["label"] for r in full]
    assert max(abs(p["probs"][k] - f["probs"][k]) for p, f in zip(precise, full, strict=True) for k in f["probs"]) < 1e-4
    assert all(p["prob"] <= f["prob"] + 1e-5 for p, f in zip(pruned, full, strict=True))  # on: the winner's, a lower bound
    assert sum(len(r["pruned"]) for r in pruned) >= sum(len(r["pruned"]) for r in precise)
    for mode in ("off", "exact"):  # records of another race are never mixed in
        refused = invoke("run", spec, items, "-o", on, "-b", 4, "--prune", mode, "--resume")
        assert refused.exit_code == 2 and "--prune" in refused.stderr
    csv = tmp_path / "out.csv"
    assert invoke("run", spec, items, "-o", csv, "-b", 4, "--prune", "on").exit_code == 0
    assert [r["pruned"] for r in read_records(str(csv)).records] == [r["pruned"] for r in pruned]


def test_the_dry_run_says_what_pruning_does(tmp_path, spec_file):
    import json

    from helpers import invoke

    labels = [f"{w} {v}" for w in WORDS[:3] for v in WORDS[3:7]]  # 12 labels
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS[:3])))
    auto = invoke("run", spec_file(labels=labels), items, "--dry-run")
    assert "every label scored to the end (--prune on would stop scoring the labels that cannot win" in auto.stderr
    for mode in ("on", "exact"):
        said = invoke("run", spec_file(labels=labels), items, "--dry-run", "--prune", mode).stderr
        assert f"labels pruned (--prune {mode};" in said
    few = invoke("run", spec_file(name="few.yaml", labels=labels[:3]), items, "--dry-run", "--prune", "off")
    assert "pruned" not in few.stderr and "to the end" not in few.stderr


def test_a_label_set_too_small_for_a_race_to_pay_is_scored_in_full_and_said(tmp_path, tiny_model_dir, monkeypatch):
    import json

    from helpers import invoke, records, write_spec

    from prefixcache.scoring import scorer

    monkeypatch.setattr(scorer, "MIN_RACE_TOKENS", 128)  # what a run uses
    labels = [f"{w} {v}" for w in WORDS[:3] for v in WORDS[3:7]]  # 12 labels of a few tokens: too few to race
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=labels)
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS[:4])))
    on, auto = tmp_path / "on.jsonl", tmp_path / "auto.jsonl"
    said = invoke("run", spec, items, "-o", on, "--prune", "on")
    assert said.exit_code == 0 and "--prune on: every label is scored to the end:" in said.stderr
    assert "candidate tokens an item are too few for a race to pay (from 128" in said.stderr
    assert invoke("run", spec, items, "-o", auto).exit_code == 0
    assert all(r["pruned"] == [] for r in records(on))
    assert [r["probs"] for r in records(on)] == [r["probs"] for r in records(auto)]  # every label scored
