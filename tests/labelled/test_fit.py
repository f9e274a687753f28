"""`prefixcache fit`: the states it reads are those of one full forward of the rendered prompt; a
head fitted where the labels are separable in the state answers every held-out item right where
the prompt does not; a fitted spec answers the same through `run` and the Python API, whatever
the batches, and continues an interrupted output; a head fitted on another model, prompt,
template or label set, or a damaged or foreign head file, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
import os

import numpy as np
import pytest
import torch
import yaml

from helpers import TEXTS, invoke, json_lines, make_spec, write_spec
from prefixcache.errors import SpecError, UsageError
from prefixcache.model.engine import Engine
from prefixcache.model.rows import Row
from prefixcache.task.head import Readout, head_bytes, load_head
from prefixcache.task.prompt import PromptBuilder
from prefixcache.task.specfile import load_spec

LABELS2 = ["billing", "technical"]
WORDS = {"billing": "refund", "technical": "crashes"}  # a word a label, repeated: far apart in any state


def _toy(tmp_path, n=40, name="labelled.jsonl"):
    """Items whose word says their label (separable in a state that reads it), of several
    lengths, in an order the labels do not follow, each text its own (copies are counted once)."""
    rows = []
    for k in range(n):
        label = LABELS2[(k * 7 + k // 3) % 2]
        rows.append({"id": f"i{k}", "text": " ".join([WORDS[label]] * (3 + k % 4)) + f" case {k}", "gold": label})
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _final_states(model, ids):
    """The lm_head's input at every position of one plain forward: [T, H]."""
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(ids)]))
    finally:
        hook.remove()
    return seen[0][0]


# -- the states ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ("shared", "standard"))
def test_states_equal_those_of_one_full_forward_of_the_rendered_prompt(arch_model, chat_tokenizer, tmp_path, backend):
    arch, model = arch_model
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    engine = Engine(model, backend)
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:6]]
    rows = [Row(e.ids, e.prefix_len, cands) for e in encoded]
    plain = engine.score(prefix, rows)
    scores, states = engine.score_with_states(prefix, rows, [[0, len(cands) - 1]] * len(rows))
    assert scores == plain  # reading the states changes no score
    for e, found in zip(encoded, states, strict=True):
        want = _final_states(model, e.ids)[-1].numpy()  # the item's last position: the first label token's
        assert found.shape == (2, want.shape[0])
        assert np.abs(found - want).max() < 1e-5, arch


def test_a_questions_states_are_read_where_its_options_start(chat_tokenizer, tmp_path):
    """A typed question's answer position is after its own text: the state there equals the full
    forward of the item's prompt followed by the question's text."""
    from conftest import tiny_model

    from prefixcache.scoring.prepare import Task
    from prefixcache.data.items import Item

    model = tiny_model("llama", len(chat_tokenizer))
    spec = make_spec(tmp_path, questions={"team": {"type": "choice", "instructions": "Which team?",
                                                   "criteria": {"billing": None, "technical": None}},
                                          "blocked": {"type": "noul", "instructions": "Is the customer blocked?"}})
    task = Task(spec, None, chat_tokenizer)
    engine = Engine(model)
    prefix = engine.prefill(task.builder.prefix_ids)
    prep = task.prepare(Item("a", {"text": TEXTS[0]}, 1))
    wanted = [at for at, _ in prep.spans]
    _, states = engine.score_with_states(prefix, [prep.row], [wanted])
    ids = list(prep.candidates.values())
    for n, at in enumerate(wanted):
        stem = ids[at][:prep.skips[at]]  # the question's text: read, not scored
        want = _final_states(model, list(prep.enc.ids) + list(stem))[-1].numpy()
        assert np.abs(states[0][n] - want).max() < 1e-5


# -- the head file's arithmetic -------------------------------------------------------------------
def test_a_head_gives_the_probabilities_of_the_regression_it_stores():
    from sklearn.linear_model import LogisticRegression
    from prefixcache.labelled.readouts import SOLVER, fit_multiclass

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 8)), rng.integers(0, 3, 60)
    mean, scale, coef, b = fit_multiclass(x, y, 3, [0.5])[0]
    r = Readout("q", ("a", "b", "c"), False, "state", mean[None], scale[None], coef, b)
    want = LogisticRegression(C=0.5, max_iter=500, solver=SOLVER).fit((x - mean) / scale, y).predict_proba((x[:5] - mean) / scale)
    for row, w in zip(x[:5], want, strict=True):
        assert np.allclose(r.probs({'state': row[None]}, [0.0] * 3), w, atol=1e-6)


# -- fit, end to end on a tiny model ----------------------------------------------------------------
@pytest.fixture
def fitted(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS2, gold="gold")
    labelled = _toy(tmp_path)
    out = tmp_path / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", out, "--folds", "4", "-q")
    assert result.exit_code == 0, result.output
    return spec, labelled, out


def test_a_head_answers_every_held_out_item_where_the_labels_are_separable(fitted, tmp_path):
    spec, labelled, out = fitted
    figures = json.loads((tmp_path / "fitted.fit.json").read_text())
    q = figures["questions"][0]
    assert q["head"]["accuracy"]["value"] == 1.0
    assert q["prompt"]["accuracy"]["value"] < 1.0  # a random model's label scores miss some
    assert q["verdict"] == "head" and q["gain"]["low"] > 0
    assert [c["per_class"] for c in q["learning_curve"]] == [1, 2, 4, 8, 16]
    table = q["risk_coverage"]  # most confident first, the last answering every item
    assert [r["coverage"] for r in table] == sorted(r["coverage"] for r in table) and table[-1]["coverage"] == 1.0
    data = yaml.safe_load(out.read_text())
    assert data["head"] == "fitted.head.safetensors" and out.read_text().startswith("# prefixcache fit:")
    assert "# chosen by prefixcache fit\n" in out.read_text() and "prefixcache tune" not in out.read_text()
    preds = tmp_path / "preds.jsonl"
    result = invoke("run", out, labelled, "-o", preds, "--metrics", tmp_path / "m.json", "-q", "--prompt-scores")
    assert result.exit_code == 0, result.output
    records = json_lines(preds)
    assert all(r["readout"] == "head" and r["correct"] for r in records)
    # its own rows lie within what held-out rows reach (the cut is their 99th percentile)
    assert all(isinstance(r["novelty"], float) for r in records) and sum(r["novelty"] > 1 for r in records) <= 2
    table = tmp_path / "preds.csv"
    said = invoke("run", out, labelled, "-o", table)
    assert said.exit_code == 0 and f"{sum(r['novelty'] > 1 for r in records)} of 40 items (" in said.stderr
    from prefixcache.data.output import read_records
    assert [r["novelty"] for r in read_records(str(table)).records] == [r["novelty"] for r in records]
    # how often held-out answers this sure were right: every held-out answer was (separable labels)
    assert all(0.5 < r["p_correct"] <= 1 for r in records)
    assert [r["p_correct"] for r in read_records(str(table)).records] == [r["p_correct"] for r in records]
    plain = json_lines(_run(spec, labelled, tmp_path / "plain.jsonl"))
    for r, p in zip(records, plain, strict=True):  # asked for, the prompt's log-probabilities are kept as they were
        assert r["logprobs"] == pytest.approx(p["logprobs"], abs=1e-5) and "readout" not in p


def test_the_report_shows_the_heads_figures_and_learning_curve(fitted, tmp_path):
    _, labelled, out = fitted
    preds = _run(out, labelled, tmp_path / "preds.jsonl")
    page = tmp_path / "report.html"
    result = invoke("report", preds, "-o", page, "--fit", tmp_path / "fitted.fit.json")
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert "the head (prefixcache fit)" in text and "the head is better" in text and "learning curve" in text
    assert "risk and coverage" in text and "<td>TF-IDF + LR</td>" in text
    fit_at = text.index("the head (prefixcache fit)")  # first, under the title and summary: no other section before it
    assert text.index("<h2>") == text.rindex("<h2>", 0, fit_at) and text.index("<h1>") < fit_at
    result = invoke("report", preds, "-o", tmp_path / "r2.html", "--fit", labelled)
    assert result.exit_code == 2 and "not the figures of prefixcache fit" in result.output


def _run(spec, items, out, *extra):
    result = invoke("run", spec, items, "-o", out, "--overwrite", "-q", *extra)
    assert result.exit_code == 0, result.output
    return out


def test_a_fitted_spec_answers_the_same_through_run_the_api_and_any_batches(fitted, tmp_path):
    from prefixcache import Classifier

    _, labelled, out = fitted
    one = json_lines(_run(out, labelled, tmp_path / "one.jsonl", "--batch-size", "1"))
    many = json_lines(_run(out, labelled, tmp_path / "many.jsonl", "--batch-size", "16"))
    rows = [json.loads(line) for line in labelled.read_text().splitlines()]
    api = list(Classifier(out, device="cpu", dtype="float32").classify(rows))
    for a, b, c in zip(one, many, api, strict=True):
        assert a["label"] == b["label"] == c["label"]
        assert a["probs"] == pytest.approx(b["probs"], abs=1e-5) and a["probs"] == pytest.approx(c["probs"], abs=1e-5)
        assert c["readout"] == "head"


def test_classifier_fit_gives_the_head_prefixcache_fit_writes(fitted, tmp_path):
    from prefixcache import Classifier

    spec, labelled, out = fitted
    rows = [json.loads(line) for line in labelled.read_text().splitlines()]
    clf = Classifier(spec, gold=None, device="cpu", dtype="float32", progress=False)
    texts = [{"id": r["id"], "text": r["text"]} for r in rows]
    golds = [r["gold"] for r in rows]
    assert clf.spec.head is None
    head = clf.fit(texts, golds, folds=4)
    assert head is clf and clf.spec.head is not None  # fit fits the classifier itself, as scikit-learn's do
    assert head.fit_figures[0]["head"]["accuracy"]["value"] == 1.0
    cli = json_lines(_run(out, labelled, tmp_path / "cli.jsonl"))
    api = list(head.classify(texts))
    for a, b in zip(api, cli, strict=True):
        assert a["label"] == b["label"] and a["probs"] == pytest.approx(b["probs"], abs=1e-6)
    assert head.predict(texts) == golds and head.score(texts, golds) == 1.0
    assert head.predict_proba(texts[:3]).shape == (3, 2) and list(head.classes_) == LABELS2
    import pandas as pd

    table = pd.DataFrame(rows)  # a DataFrame and the name of its label column
    again = clf.fit(table, "gold", folds=4, prompt_sample=5)  # the prompt alone measured on 5 items, as --prompt-sample
    assert again.predict(table) == golds and again.fit_figures[0]["prompt_items"] == 5
    with pytest.raises(UsageError, match="prompt_sample must be 1 or more"):
        clf.fit(table, "gold", prompt_sample=0)


def test_a_classifier_works_with_scikit_learns_clone_pipeline_and_cross_validation(fitted):
    from sklearn.base import clone
    from sklearn.model_selection import cross_val_score
    from sklearn.pipeline import Pipeline

    from prefixcache import Classifier

    spec, labelled, _ = fitted
    rows = [json.loads(line) for line in labelled.read_text().splitlines()]
    texts, golds = [r["text"] for r in rows], [r["gold"] for r in rows]
    clf = Classifier(spec, gold=None, device="cpu", dtype="float32", progress=False)
    twin = clone(clf)
    assert twin is not clf and twin.get_params() == clf.get_params() and twin.spec.head is None
    assert twin.scorer.engine is clf.scorer.engine  # a clone shares the loaded model
    clf.fit(texts, golds, folds=3)
    assert clone(clf).spec.head is None  # a clone is unfitted, as scikit-learn's are
    prompt_alone = twin.score(texts, golds)
    scores = cross_val_score(Pipeline([("clf", twin)]), texts, golds, cv=3)
    assert len(scores) == 3 and min(scores) == 1.0 > prompt_alone  # each fold's head, fitted on the others
    assert twin.set_params(batch_size=4) is twin and twin.batching.size == 4 and twin.spec.head is None


def test_bench_and_zero_shot_labels_take_a_fitted_spec(fitted, tmp_path):
    from prefixcache import Classifier

    _, labelled, out = fitted
    result = invoke("bench", out, labelled, "--limit", "2", "--max-items", "4")
    assert result.exit_code == 0, result.output
    assert "bench: timing the spec's prompt scoring (every option)" in result.stderr
    clf = Classifier(out, device="cpu", dtype="float32", progress=False)
    found = clf("refund refund", candidate_labels=["refund", "bug"])  # other labels: the prompt answers
    assert set(found["labels"]) == {"refund", "bug"}


def test_an_interrupted_fitted_run_continues_to_the_same_records(fitted, tmp_path):
    _, labelled, out = fitted
    whole = json_lines(_run(out, labelled, tmp_path / "whole.jsonl", "--batch-size", "8"))
    part = tmp_path / "part.jsonl"
    lines = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:13]))  # as a kill mid-batch leaves it
    (tmp_path / "part.jsonl.prefixcache.json").write_text((tmp_path / "whole.jsonl.prefixcache.json").read_text())
    result = invoke("run", out, labelled, "-o", part, "--resume", "--batch-size", "8", "-q")
    assert result.exit_code == 0, result.output
    resumed = json_lines(part)
    assert [r["id"] for r in resumed] == [r["id"] for r in whole]
    for a, b in zip(resumed, whole, strict=True):
        assert a["label"] == b["label"] and a["probs"] == pytest.approx(b["probs"], abs=1e-6)


@pytest.mark.parametrize("change, what", [
    ({"system": "You route tickets, tersely."}, "prompt prefix"),
    ({"template": "Message: {text}"}, "item prompt"),
    ({"labels": ["billing", "technical", "account"]}, "label set or questions"),
])
def test_a_fitted_spec_refuses_a_changed_prompt_template_or_label_set(fitted, tmp_path, change, what):
    _, labelled, out = fitted
    data = {**yaml.safe_load(out.read_text()), **change}
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(data))
    result = invoke("run", edited, labelled, "-o", tmp_path / "x.jsonl", "-q")
    assert result.exit_code == 2
    assert f"this head was fitted with another {what}" in result.output and "fit it again" in result.output


def test_a_fitted_spec_refuses_another_model(fitted, tmp_path, chat_tokenizer):
    from conftest import tiny_model

    _, labelled, out = fitted
    other = tmp_path / "other-model"
    tiny_model("llama", len(chat_tokenizer), seed=1).save_pretrained(other)
    chat_tokenizer.save_pretrained(other)
    result = invoke("run", out, labelled, "-o", tmp_path / "x.jsonl", "-m", other, "-q")
    assert result.exit_code == 2 and "this head was fitted with another model" in result.output


def test_a_fitted_spec_refuses_exact_and_says_pruning_does_not_apply(fitted, tmp_path):
    _, labelled, out = fitted
    result = invoke("run", out, labelled, "-o", tmp_path / "x.jsonl", "--exact", "--dtype", "bfloat16", "-q")
    assert result.exit_code == 2 and "--exact" in result.output and "head" in result.output


# -- hostile and damaged head files ---------------------------------------------------------------
def _damaged(good: bytes, how: str) -> bytes:
    from safetensors.numpy import load, save

    meta = json.loads(good[8: 8 + int.from_bytes(good[:8], "little")])["__metadata__"]
    arrays = load(good)
    if how == "truncated":
        return good[: len(good) // 2]
    if how == "nan":
        arrays["0.coef"] = arrays["0.coef"].copy()
        arrays["0.coef"][0, 0] = np.nan
        return save(arrays, metadata=meta)
    if how == "shape":
        arrays["0.coef"] = arrays["0.coef"][:, :-1].copy()
        return save(arrays, metadata=meta)
    if how == "pickle":
        import pickle

        return pickle.dumps({"coef": [1, 2]})
    if how == "header":
        info = json.loads(meta["prefixcache_head"])
        info["questions"][0]["options"] = "billing"
        return save(arrays, metadata={"prefixcache_head": json.dumps(info)})
    if how == "deep":
        return save(arrays, metadata={"prefixcache_head": "[" * 100000 + "]" * 100000})
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "nan", "shape", "pickle", "header", "deep"])
def test_a_damaged_head_file_is_refused_before_the_model_loads(fitted, tmp_path, how):
    _, labelled, out = fitted
    head = tmp_path / "fitted.head.safetensors"
    head.write_bytes(_damaged(head.read_bytes(), how))
    with pytest.raises(SpecError, match="not a head file written by prefixcache fit"):
        load_spec(out)
    result = invoke("run", out, labelled, "-o", tmp_path / "x.jsonl", "-q")
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "head" in result.output


def _tampered(good: bytes, how: str) -> bytes:
    """The head file with its header or weights changed as an attacker (or a bad copy) would."""
    from safetensors.numpy import load, save

    meta = json.loads(good[8: 8 + int.from_bytes(good[:8], "little")])["__metadata__"]
    info, arrays = json.loads(meta["prefixcache_head"]), load(good)
    q = info["questions"][0]
    if how == "renamed":
        q["options"] = ["x", "y"]
    elif how == "reordered":
        q["options"] = q["options"][::-1]
    elif how == "repeated":
        q["options"] = [q["options"][0]] * 2
    elif how == "other-question":
        q["id"] = "nothing"
    elif how == "layer":
        info["layer"] = "middle"
    elif how == "two-readouts":
        info["questions"] = [q, dict(q)]
        arrays.update({"1." + k.split(".", 1)[1]: v for k, v in arrays.items()})
        info["weights"] = __import__("prefixcache.task.head", fromlist=["x"]).weights_digest(arrays)
    elif how == "bit-flip":  # a finite weight made huge: every answer changes
        flipped = bytearray(good)
        at = 8 + int.from_bytes(good[:8], "little") + 3
        flipped[at] ^= 0x7f
        return bytes(flipped)
    return save(arrays, metadata={"prefixcache_head": json.dumps(info)})


@pytest.mark.parametrize("how, says", [
    ("renamed", "fitted with another label set or questions"), ("reordered", "fitted with another label set"),
    ("repeated", "not a head file"), ("other-question", "a question the spec does not ask"),
    ("layer", "names layer 'middle'"), ("two-readouts", "two readouts for one question"),
    ("bit-flip", "its weights' digest is not its header's"),
])
def test_a_head_whose_header_disagrees_with_itself_or_the_spec_is_refused(fitted, tmp_path, how, says):
    _, labelled, out = fitted
    head = tmp_path / "fitted.head.safetensors"
    head.write_bytes(_tampered(head.read_bytes(), how))
    with pytest.raises(SpecError, match=says):
        load_spec(out)
    result = invoke("run", out, labelled, "-o", tmp_path / "x.jsonl", "-q")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output


def test_an_empty_head_key_is_refused(fitted, tmp_path):
    _, _, out = fitted
    empty = tmp_path / "empty.yaml"
    empty.write_text(out.read_text().replace("head: fitted.head.safetensors", "head:"))
    with pytest.raises(SpecError, match="'head' is empty"):
        load_spec(empty)


def test_a_head_someone_else_can_change_is_refused(fitted, tmp_path):
    _, _, out = fitted
    head = tmp_path / "fitted.head.safetensors"
    os.chmod(head, 0o664)
    with pytest.raises(SpecError, match="can be written by other users"):
        load_spec(out)
    os.chmod(head, 0o644)
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(head, 12345, -1)
    with pytest.raises(SpecError, match="belongs to another user"):
        load_spec(out)
    os.chown(head, 0, -1)


def test_a_link_another_user_made_on_the_way_to_a_head_is_refused(fitted, tmp_path):
    _, _, out = fitted
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    os.chmod(shared, 0o1777)
    spec = shared / "spec.yaml"
    spec.write_text(out.read_text().replace("head: fitted.head.safetensors", "head: planted.head.safetensors"))
    planted = shared / "planted.head.safetensors"
    planted.symlink_to(Path("..") / "fitted.head.safetensors")  # a link of one's own is followed, `..` and all
    assert load_spec(spec).head is not None
    if os.geteuid() != 0:
        pytest.skip("a link made by another user needs root")
    os.lchown(planted, 12345, 12345)
    with pytest.raises(SpecError, match=r"planted.head.safetensors is a link made by another user \(uid 12345\)"):
        load_spec(spec)
    planted.unlink()
    (shared / "folder").symlink_to(tmp_path)  # a link in the folders on the way counts as much
    os.lchown(shared / "folder", 12345, 12345)
    spec.write_text(out.read_text().replace("head: fitted.head.safetensors", "head: folder/fitted.head.safetensors"))
    with pytest.raises(SpecError, match="folder is a link made by another user"):
        load_spec(spec)


def test_a_head_round_trips_through_its_file(tmp_path):
    rng = np.random.default_rng(1)
    r = Readout("labels", ("a", "b"), True, "state+logprobs", rng.normal(size=(2, 5)), np.ones((2, 5)),
                rng.normal(size=(2, 5)), rng.normal(size=2))
    fp = {"model": "m", "prefix": "p", "template": "t", "questions": "q"}
    path = tmp_path / "h.safetensors"
    path.write_bytes(head_bytes([r], fp, "final", {}))
    os.chmod(path, 0o644)
    back = load_head(str(path), tmp_path / "spec.yaml").readouts[0]
    states = rng.normal(size=(2, 4))
    assert back.probs({'state': states}, [-0.1, -2.0]) == pytest.approx(r.probs({'state': states}, [-0.1, -2.0]), abs=1e-6)


def test_a_head_of_several_views_round_trips_and_is_refused_where_they_cannot_be_read(tmp_path):
    from prefixcache.task.features import Features

    rng = np.random.default_rng(2)
    r = Readout("label", ("a", "b", "c"), False, "state@2+mean@2", rng.normal(size=(1, 8)), np.ones((1, 8)),
                rng.normal(size=(3, 8)), rng.normal(size=3))
    fp = {"model": "m", "prefix": "p", "template": "t", "questions": "q"}
    path = tmp_path / "h.safetensors"
    path.write_bytes(head_bytes([r], fp, "final", {}))
    os.chmod(path, 0o644)
    head = load_head(str(path), tmp_path / "spec.yaml")
    views = {"state@2": rng.normal(size=(1, 4)), "mean@2": rng.normal(size=(1, 4))}
    assert head.readouts[0].probs(views, None) == pytest.approx(r.probs(views, None), abs=1e-6)
    assert head.views == ("mean@2", "state@2") and head.readouts[0].hidden == 4
    head.check_width(4, 3)
    with pytest.raises(SpecError, match="reads layer 2, and the model has 1"):
        head.check_width(4, 1)
    with pytest.raises(SpecError, match="this engine gives the final state at the answer position alone"):
        head.check_width(4, 0)  # the llama.cpp engine
    for bad in ("state+state", "states", "mean@0", "logprobs", "state+logprobs+mean", ""):
        with pytest.raises(ValueError):
            Features.parse(bad)
    assert Features.parse("state@15+mean@15+logprobs").layers == (15,)
    bad_width = Readout("label", ("a", "b", "c"), False, "state+mean", rng.normal(size=(1, 7)), np.ones((1, 7)),
                        rng.normal(size=(3, 7)), rng.normal(size=3))  # 7 columns cannot be two views
    path.write_bytes(head_bytes([bad_width], fp, "final", {}))
    with pytest.raises(SpecError, match="its width 7 is not that of state\\+mean"):
        load_head(str(path), tmp_path / "spec.yaml")


# -- what fit refuses ------------------------------------------------------------------------------
def test_fit_refuses_multiple_choice_and_a_spec_without_gold(tmp_path, tiny_model_dir):
    labelled = _toy(tmp_path)
    mc = write_spec(tmp_path, name="mc.yaml", model=str(tiny_model_dir), labels=None, choices="options")
    result = invoke("fit", mc, labelled, "-o", tmp_path / "f.yaml")
    assert result.exit_code == 2 and "choices" in result.output
    plain = write_spec(tmp_path, name="plain.yaml", model=str(tiny_model_dir), labels=LABELS2)
    result = invoke("fit", plain, labelled, "-o", tmp_path / "f.yaml")
    assert result.exit_code == 2 and "--gold" in result.output
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps({**json.loads(line), "gold": LABELS2[0]}) + "\n"
                           for line in labelled.read_text().splitlines()))
    result = invoke("fit", plain, one, "--gold", "gold", "-o", tmp_path / "f.yaml")
    assert result.exit_code == 2 and f"every labelled item has the gold {LABELS2[0]!r}" in result.stderr
    assert "loading" not in result.stderr  # refused before any model reads an item


def test_fit_of_tags_writes_a_threshold_per_label(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS2, multi_label=True, gold="gold")
    rows = [json.loads(line) for line in _toy(tmp_path).read_text().splitlines()]
    for k, r in enumerate(rows):  # some items carry both labels
        r["gold"] = r["gold"] + (",billing" if k % 5 == 0 and r["gold"] == "technical" else "")
    labelled = tmp_path / "tags.jsonl"
    labelled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tags-fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", out, "--folds", "3", "-q")
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(out.read_text())
    assert set(data["threshold"]) == set(LABELS2)
    preds = json_lines(_run(out, labelled, tmp_path / "tags-out.jsonl"))
    assert all(r["readout"] == "head" and set(r["probs"]) == set(LABELS2) for r in preds)
    # it answers alone, reading one state a label: a row costs its batch what it feeds the model
    from prefixcache.data.items import Item
    from prefixcache.run.options import RunOptions
    from prefixcache.run.plan import make_plan
    from prefixcache.scoring.prepare import Task
    from prefixcache.scoring.reading import alone_row
    from prefixcache.task.specfile import load_spec

    fitted = load_spec(out)
    plan = make_plan(RunOptions(out, str(labelled), output=str(tmp_path / "x.jsonl")))
    assert fitted.head_alone() and plan.batching.head_alone and plan.batching.judged == (True,)
    task = Task.from_spec(fitted, tmp_path / "cache")
    prep = task.prepare(Item("x", rows[0], 1))
    row, _ = alone_row(task, prep, fitted.head.reads(task.questions))
    assert len(row.candidates) == len(LABELS2)
    fed = len(row.ids) - row.prefix_len + sum(len(c) for c in row.candidates)
    assert plan.batching.cost(prep) == fed


# -- an interrupted fit continues ---------------------------------------------------------------
def test_an_interrupted_fit_continues_from_the_states_it_kept(tmp_path, tiny_model_dir, monkeypatch):
    """Rows are kept one by one: an interrupted fit forwards only the rows it had not read, a
    grown file only its new rows, and a state-alone fit forwards no option token at all but those
    of the sample the prompt alone is measured on."""
    from prefixcache.run.options import RunOptions
    from prefixcache.scoring.scorer import Scorer
    from prefixcache.labelled.fit import FitOptions, fit

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS2, gold="gold")
    rows = [json.loads(line) for line in _toy(tmp_path, n=50).read_text().splitlines()]
    labelled = tmp_path / "distinct.jsonl"  # every prompt its own: none is read back for another
    labelled.write_text("".join(json.dumps({**r, "text": f"{r['text']} {r['id']}"}) + "\n" for r in rows[:40]))
    states, scored = [], []
    real_states, real_score = Scorer.states_alone, Scorer.score
    monkeypatch.setattr(Scorer, "states_alone", lambda self, preps, *a: states.append(len(preps)) or
                        real_states(self, preps, *a))
    monkeypatch.setattr(Scorer, "score", lambda self, preps, *a: scored.append(len(preps)) or real_score(self, preps, *a))

    def options(out, cache, sample=10):
        return FitOptions(RunOptions(spec, str(labelled), batch_size=8, cache_dir=cache), out, folds=4,
                          prompt_sample=sample, overwrite=True)

    def stop_after_two_batches(what, done, total):
        if what == "reading states" and done >= 16:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(options(tmp_path / "a.yaml", tmp_path / "cache"), stop_after_two_batches)
    assert states == [8, 8] and not scored and not (tmp_path / "a.yaml").exists()
    result = fit(options(tmp_path / "a.yaml", tmp_path / "cache"))
    assert states == [8, 8, 8, 8, 8] and sum(scored) == 10  # the kept rows read back, not forwarded
    assert result.read.forwards == 24 + 10 and result.kept == 16 and result.judged[0].prompt_items == 10
    fit(options(tmp_path / "b.yaml", tmp_path / "fresh-cache"))  # uninterrupted, from nothing
    assert (tmp_path / "a.head.safetensors").read_bytes() == (tmp_path / "b.head.safetensors").read_bytes()
    states.clear(), scored.clear()
    with labelled.open("a") as f:  # the file grows by ten rows
        f.write("".join(json.dumps({**r, "text": f"{r['text']} {r['id']}"}) + "\n" for r in rows[40:]))
    grown = fit(options(tmp_path / "a.yaml", tmp_path / "cache", sample=None))
    assert sum(states) == 10 and grown.kept == 40  # only the new rows go through the model
    result = invoke("cache", "clear", "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0 and not (tmp_path / "cache" / "states").exists()


def test_a_state_alone_fit_feeds_no_option_token(tmp_path, tiny_model_dir, monkeypatch):
    """A fit of heads of the states alone feeds the model the items' tokens and one candidate
    token an answer position (no trie node): the only option tokens fed are those of the items
    the prompt alone is measured on (here one)."""
    from prefixcache.run.options import RunOptions
    from prefixcache.labelled import passes
    from prefixcache.labelled.fit import FitOptions, fit

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS2, gold="gold")
    labelled = _toy(tmp_path, n=30)
    built, real = [], passes.fit_scorer
    monkeypatch.setattr(passes, "fit_scorer", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    options = FitOptions(RunOptions(spec, str(labelled), cache_dir=tmp_path / "cache"), tmp_path / "f.yaml", folds=3,
                         prompt_sample=1)
    result = fit(options)
    assert result.read.scored.sum() == 1 and result.read.forwards == 31
    assert built[0].engine.label_tokens == passes.option_tokens(built[0].task)  # one item's options: its trie


# -- the decisions server and decide ---------------------------------------------------------------
def test_decide_answers_a_fitted_pack_with_its_head_as_run_does(tmp_path, tiny_model_dir):
    """A head fitted on a spec of the server's shape (system: the instructions, template: "{state}")
    answers the requests that ask its questions with those instructions, as `run` answers the items."""
    questions = {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "technical": None},
                          "gold": "gold"},
                 "blocked": {"type": "noul", "instructions": "Is the customer blocked?"}}
    spec = write_spec(tmp_path, model=str(tiny_model_dir), system="Route the ticket.", template="{state}",
                      questions=questions)
    rows = [json.loads(line) for line in _toy(tmp_path).read_text().splitlines()]
    labelled = tmp_path / "states.jsonl"
    labelled.write_text("".join(json.dumps({"id": r["id"], "state": r["text"], "gold": r["gold"]}) + "\n" for r in rows))
    fitted = tmp_path / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", fitted, "--folds", "4", "-q")
    assert result.exit_code == 0, result.output
    records = json_lines(_run(fitted, labelled, tmp_path / "run.jsonl"))
    assert all(r["readout"] == {"team": "head", "blocked": "prompt"} for r in records)
    asked = {k: {kk: vv for kk, vv in v.items() if kk != "gold"} for k, v in questions.items()}
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"model": "local", "instructions": "Route the ticket.", "state": r["text"],
                                            "questions": asked}) + "\n" for r in rows[:12]))
    out = tmp_path / "responses.jsonl"
    result = invoke("decide", requests, "-o", out, "-m", tiny_model_dir, "--head", tmp_path / "fitted.head.safetensors",
                    "-b", 5, "-q")
    assert result.exit_code == 0, result.output
    for line, record in zip(json_lines(out), records[:12], strict=True):  # the first 12 were asked
        answers = line["response"]["body"]["answers"]
        assert answers["team"]["x_readout"] == "head" and "x_readout" not in answers["blocked"]
        assert answers["team"]["choice"] == record["answers"]["team"]["choice"]
        for option, p in record["answers"]["team"]["probabilities"].items():
            assert answers["team"]["probabilities"][option] == pytest.approx(p, abs=1e-5)
    import pandas as pd

    from prefixcache.serve.raydata import Decide  # decide on Ray Data: the same head, read where it runs

    decided = Decide(str(tiny_model_dir), heads=[tmp_path / "fitted.head.safetensors"], batch_size=5)(
        pd.DataFrame({"text": requests.read_text().splitlines()}))
    for body, line in zip(decided["body"], json_lines(out), strict=True):
        got, want = json.loads(body)["answers"]["team"], line["response"]["body"]["answers"]["team"]
        assert got["x_readout"] == "head" and got["choice"] == want["choice"]
        assert got["probabilities"] == pytest.approx(want["probabilities"], abs=1e-6)
    other = tmp_path / "other.jsonl"  # other instructions: the head is not applied
    other.write_text(requests.read_text().replace("Route the ticket.", "Route it."))
    result = invoke("decide", other, "-o", tmp_path / "o.jsonl", "-m", tiny_model_dir, "--head",
                    tmp_path / "fitted.head.safetensors", "-q")
    assert result.exit_code == 0
    for line in json_lines(tmp_path / "o.jsonl"):  # answered by the prompt, saying why
        team = line["response"]["body"]["answers"]["team"]
        assert team["x_readout"] == "prompt" and "was fitted with another prompt prefix" in team["x_readout_why"]


@pytest.mark.parametrize("binary", (False, True))
def test_a_readout_wider_than_its_items_is_the_regression_on_every_feature(binary):
    """Fitted in the span of the items' features (more features than items), a readout's weights
    and probabilities are those of the same regression fitted on every feature."""
    from sklearn.linear_model import LogisticRegression

    from prefixcache.labelled.readouts import fit_binary, fit_multiclass

    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 200)) * rng.uniform(0.5, 3, size=200)  # 24 items, 200 features
    y = (x[:, 0] + x[:, 1] > 0).astype(int) if binary else np.arange(24) % 3
    mean, scale, coef, intercept = (fit_binary(x, y.astype(bool), [0.5]) if binary else fit_multiclass(x, y, 3, [0.5]))[0]
    z = (x - mean) / scale
    plain = LogisticRegression(C=0.5, max_iter=5000, tol=1e-10).fit(z, y)
    want = plain.predict_proba(z)
    logits = z @ (coef[:, None] if binary else coef.T) + intercept
    got = np.concatenate([1 - 1 / (1 + np.exp(-logits)), 1 / (1 + np.exp(-logits))], axis=1) if binary else \
        np.exp(logits - logits.max(1, keepdims=True)) / np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)
    assert np.abs(got - want).max() < 1e-3


def test_a_head_refuses_a_pack_whose_option_descriptions_were_reworded(tmp_path, tiny_model_dir):
    """A typed question's option descriptions are text the model reads: a head fitted under one
    wording is refused under another."""
    questions = {"team": {"type": "choice", "instructions": "Which team?", "gold": "gold",
                          "criteria": {"billing": "money matters", "technical": "software faults"}}}
    spec = write_spec(tmp_path, model=str(tiny_model_dir), template="{state}", questions=questions)
    rows = [json.loads(line) for line in _toy(tmp_path, n=12).read_text().splitlines()]
    labelled = tmp_path / "states.jsonl"
    labelled.write_text("".join(json.dumps({"id": r["id"], "state": r["text"], "gold": r["gold"]}) + "\n" for r in rows))
    assert invoke("fit", spec, labelled, "-o", tmp_path / "fitted.yaml", "--folds", "3", "-q").exit_code == 0
    fitted = tmp_path / "fitted.yaml"
    assert invoke("run", fitted, labelled, "-o", tmp_path / "a.jsonl", "-q").exit_code == 0
    fitted.write_text(fitted.read_text().replace("software faults", "anything that breaks"))
    result = invoke("run", fitted, labelled, "-o", tmp_path / "b.jsonl", "-q")
    assert result.exit_code == 2 and "this head was fitted with another label set or questions" in result.output


def test_copies_of_a_text_are_kept_in_one_fold(tmp_path, tiny_model_dir):
    """Folds never split the copies of one text (under other ids): no item is judged by a head
    fitted on its copy; without copies, the folds are those without groups."""
    from prefixcache.reports.resampling import cv_splits

    strata = [str(k % 3) for k in range(30)]
    groups = [f"t{k // 2}" for k in range(30)]  # each text twice
    for train, test in cv_splits(strata, 5, 1, groups):
        assert not {groups[i] for i in train} & {groups[i] for i in test}
    plain = cv_splits(strata, 5, 1)
    alone = cv_splits(strata, 5, 1, [f"u{k}" for k in range(30)])
    assert all((a[1] == b[1]).all() for a, b in zip(plain, alone, strict=True))
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS2, gold="gold")
    rows = [json.loads(line) for line in _toy(tmp_path, n=16).read_text().splitlines()]
    doubled = tmp_path / "doubled.jsonl"
    doubled.write_text("".join(json.dumps({**r, "id": r["id"] + suffix, "text": f"{r['text']} {r['id']}"}) + "\n"
                               for r in rows for suffix in ("", "-copy")))
    assert invoke("fit", spec, doubled, "-o", tmp_path / "f.yaml", "--folds", "4", "-q").exit_code == 0
    question = json.loads((tmp_path / "f.fit.json").read_text())["questions"][0]
    assert any("16 labelled items are copies of another's text" in n for n in question["notes"]), question["notes"]
    assert question["items"] == 32 and question["texts"] == 16  # every figure counts a text once
    assert max(row["answered"] for row in question["risk_coverage"]) == 16


def test_classifier_fit_refuses_bad_labels_with_the_librarys_typed_errors(fitted):
    import math

    from prefixcache import Classifier
    from prefixcache.errors import InputError, UsageError

    spec, labelled, _ = fitted
    rows = [json.loads(line) for line in labelled.read_text().splitlines()]
    texts, golds = [r["text"] for r in rows], [r["gold"] for r in rows]
    clf = Classifier(spec, gold=None, device="cpu", dtype="float32", progress=False)
    with pytest.raises(InputError, match=r"item 40 \(label 'sales'\) has gold 'sales', which is not one of the labels"):
        clf.fit(texts, golds[:-1] + ["sales"], folds=3)
    with pytest.raises(InputError, match=r"item 40 \(label nan\)"):
        clf.fit(texts, golds[:-1] + [math.nan], folds=3)
    with pytest.raises(InputError, match="item 40 .* has no value in field 'text'"):
        clf.fit([{"text": t} for t in texts[:-1]] + [{"text": math.nan}], golds, folds=3)  # a DataFrame's NaN
    with pytest.raises(UsageError, match="folds must be 2 or more"):
        clf.fit(texts, golds, folds=1)


def test_near_copies_by_the_models_reading_are_listed_and_exact_copies_are_not():
    from prefixcache.data.items import Item
    from prefixcache.labelled.fit import near_copies

    rng = np.random.default_rng(0)
    states = rng.standard_normal((12, 1, 64))
    states[5] = states[2] + 0.01 * rng.standard_normal((1, 64))  # read alike, another text
    states[9] = states[4]  # read alike, the same text (an exact copy: folded together, not listed)
    items = [Item(f"t{k}", {"text": f"text {k}"}, k + 1) for k in range(12)]
    groups = np.array([f"g{k}" for k in range(12)])
    groups[9] = groups[4]
    notes = near_copies(items, groups, {"state": states})
    assert len(notes) == 1 and notes[0].startswith("1 pair of labelled items of other texts the model reads alike")
    assert "'t2' and 't5'" in notes[0] and "'t4'" not in notes[0]
    assert near_copies(items, np.array([f"g{k}" for k in range(12)]), {"state": rng.standard_normal((12, 1, 64))}) == []


@pytest.mark.parametrize("gain, verdict, items, prompt_items, words", [
    ((0.10, 0.02, 0.18), "head", 60, 60, "the head is better beyond noise"),
    ((-0.10, -0.18, -0.02), "prompt", 60, 60, "the prompt alone is better beyond noise"),
    ((0.10, -0.10, 0.30), "tie", 40, 40, "not enough labels to tell: the gain lies in [-0.100, +0.300]; about 160 "
                                          "labelled items (120 more) would tell them apart at this gain"),
    ((0.10, -0.10, 0.30), "tie", 200, 20, "not enough labels to tell: the gain lies in [-0.100, +0.300]; the prompt "
                                           "measured on about 80 items (--prompt-sample 80) would tell them apart"),
    ((0.001, -0.2, 0.2), "tie", 40, 40, "not enough labels to tell: the gain lies in [-0.200, +0.200]; the two "
                                         "answer alike"),
])
def test_the_verdicts_words_follow_the_gains_interval(gain, verdict, items, prompt_items, words):
    """A wide interval is "not enough labels to tell", never "as good"; the items that would tell
    them apart scale as the interval's half-width over the gain, squared."""
    from prefixcache.labelled.data import Choice
    from prefixcache.labelled.heads import Judged
    from prefixcache.reports.resampling import Figure

    judged = Judged("label", False, items, 5, {}, {}, Figure(*gain), verdict, Choice(1.0, "state"), {},
                    prompt_items=prompt_items)
    assert judged.verdict_words.startswith(words)


def test_planted_label_flips_are_listed_as_likely_errors_and_a_weak_head_flags_nothing():
    from prefixcache.labelled.data import Labelled
    from prefixcache.labelled.hygiene import likely_errors

    rng = np.random.default_rng(3)
    n, k = 60, 3
    truth = np.arange(n) % k
    probs = np.full((n, k), 0.03)
    probs[np.arange(n), truth] = 0.94
    probs += rng.uniform(0, 0.02, probs.shape)
    probs /= probs.sum(axis=1, keepdims=True)
    gold = truth.copy()
    flipped = [4, 17, 33, 50]
    gold[flipped] = (truth[flipped] + 1) % k
    data = Labelled("q", ("a", "b", "c"), False, {}, np.zeros((n, k)), gold, probs, gold,
                    ids=tuple(f"r{i}" for i in range(n)))
    found = likely_errors(data, probs)
    assert sorted(s["id"] for s in found) == sorted(f"r{i}" for i in flipped)
    assert all(s["read_as"] == "abc"[truth[int(s["id"][1:])]] for s in found)
    unsure = np.full((n, k), 1 / k) + rng.uniform(0, 0.05, (n, k))
    assert likely_errors(data, unsure / unsure.sum(axis=1, keepdims=True)) == []


def test_tfidf_beside_the_head_on_the_same_folds(fitted, tmp_path):
    """The model-free baseline's held-out figures are printed and written beside the head's."""
    spec, labelled, _ = fitted
    result = invoke("fit", spec, labelled, "-o", tmp_path / "b.yaml", "--folds", "4")
    assert result.exit_code == 0, result.output
    assert "TF-IDF + LR" in result.stderr
    question = json.loads((tmp_path / "b.fit.json").read_text())["questions"][0]
    assert 0 <= question["tfidf_baseline"]["accuracy"]["value"] <= 1 and "ece" in question["tfidf_baseline"]


def test_a_head_is_refused_on_states_read_in_another_precision(fitted, tmp_path):
    """A head keeps the engine and precision that read its states; read otherwise, its states
    differ, so the run is refused in one line saying how to run it."""
    _, labelled, out = fitted
    from prefixcache.task.head import load_head

    head = load_head(str(out.parent / "fitted.head.safetensors"), out)
    assert head.fitted["engine"] == {"name": "transformers", "precision": "float32"}
    result = invoke("run", out, labelled, "-o", tmp_path / "bf16.jsonl", "--dtype", "bfloat16", "-q")
    assert result.exit_code == 2
    assert "this head was fitted on states transformers read in float32" in result.stderr
    assert "run it with --dtype float32" in result.stderr
