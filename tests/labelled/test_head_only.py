"""A fitted head of the state alone (`fit --features state`) answers alone: the same labels and probabilities as with
--prompt-scores, no option token through the model, records without log-probabilities (CSV
too, resumed)."""

from __future__ import annotations

import csv
import json

import pytest
from helpers import invoke, json_lines, write_spec

pytest.importorskip("sklearn")
LABELS = ["billing", "technical"]


def _labelled(path, n, start=0):
    words = {"billing": "invoice refund", "technical": "crash error"}
    rows = [{"id": f"i{k}", "text": " ".join([words[LABELS[k % 2]]] * (1 + k % 3)), "gold": LABELS[k % 2]}
            for k in range(start, start + n)]
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("head-only")
    spec = write_spec(tmp, model=str(tiny_model_dir), labels=LABELS, gold="gold")
    labelled = _labelled(tmp / "labelled.jsonl", 24)
    out = tmp / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", out, "--folds", "3", "-q", "--features", "state")
    assert result.exit_code == 0, result.output
    assert "logprobs" not in json.loads((tmp / "fitted.fit.json").read_text())["questions"][0]["chosen"]["features"]
    return out, labelled


def test_head_only_records_equal_those_with_prompt_scores(fitted, tmp_path):
    out, labelled = fitted
    alone, scored = tmp_path / "alone.jsonl", tmp_path / "scored.jsonl"
    assert invoke("run", out, labelled, "-o", alone).exit_code == 0
    assert invoke("run", out, labelled, "-o", scored, "--prompt-scores").exit_code == 0
    a, s = json_lines(alone), json_lines(scored)
    assert all("logprobs" not in r and r["readout"] == "head" for r in a) and all("logprobs" in r for r in s)
    assert [r["label"] for r in a] == [r["label"] for r in s]
    assert max(abs(x["probs"][n] - y["probs"][n]) for x, y in zip(a, s, strict=True) for n in LABELS) < 1e-5  # float rounding


def test_no_option_token_goes_through_the_model(fitted):
    from prefixcache import Classifier

    out, labelled = fitted
    texts = [json.loads(line) for line in labelled.read_text().splitlines()]
    fed = []
    for prompt_scores in (False, True):
        clf = Classifier(out, progress=False, prompt_scores=prompt_scores)
        before = clf.scorer.engine.label_tokens  # a model loaded once is shared by the classifiers of it
        list(clf.classify(texts))
        fed.append((clf.scorer.head_only, clf.scorer.engine.label_tokens - before))
    assert fed[0] == (True, 0) and not fed[1][0] and fed[1][1] > 0


def test_a_head_only_csv_output_resumes_to_the_uninterrupted_records(fitted, tmp_path):
    out, _ = fitted
    items = _labelled(tmp_path / "in.jsonl", 6)
    part = tmp_path / "part.csv"
    assert invoke("run", out, items, "-o", part).exit_code == 0
    _labelled(items, 6, start=6)
    resumed = invoke("run", out, items, "-o", part, "--resume")
    assert resumed.exit_code == 0, resumed.output
    whole = tmp_path / "whole.csv"
    assert invoke("run", out, items, "-o", whole).exit_code == 0
    rows = lambda path: [{k: v for k, v in r.items() if k != "ms"} for r in csv.DictReader(path.open())]  # noqa: E731
    assert rows(part) == rows(whole) and len(rows(whole)) == 12
    assert all(r["logprob_billing"] == "" for r in rows(whole))  # the columns stay, empty


def test_a_head_reading_the_options_scores_keeps_them(tmp_path, tiny_model_dir):
    from prefixcache import Classifier

    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS, gold="gold")
    labelled = _labelled(tmp_path / "labelled.jsonl", 24)
    out = tmp_path / "fitted.yaml"
    assert invoke("fit", spec, labelled, "-o", out, "--folds", "3", "-q", "--features", "auto").exit_code == 0
    chosen = json.loads((tmp_path / "fitted.fit.json").read_text())["questions"][0]["chosen"]["features"]
    clf = Classifier(out, progress=False)
    assert clf.scorer.head_only == ("logprobs" not in chosen)  # auto may choose either; the scorer follows the head
    assert clf.spec.head_alone() == clf.scorer.head_only == clf.batching.head_alone  # the batches follow it too


def test_dry_run_counts_and_times_what_the_head_alone_feeds(fitted):
    out, labelled = fitted
    alone = invoke("run", out, labelled, "--dry-run")
    scored = invoke("run", out, labelled, "--dry-run", "--prompt-scores")
    assert alone.exit_code == 0 == scored.exit_code, alone.output + scored.output
    a, s = json_lines_of(alone.stdout), json_lines_of(scored.stdout)
    assert all(r["label_tokens"] == 1 for r in a)  # one answer position, its first token
    assert all(r["label_tokens"] > 1 for r in s)  # every label's tokens (their trie)
    assert "the fitted head answers alone: no option is scored" in alone.stderr
    assert "label tokens to score" in scored.stderr


def test_bench_times_the_head_alone_beside_the_prompt_scoring(fitted):
    out, labelled = fitted
    result = invoke("bench", out, labelled, "--limit", "2", "--max-items", "6", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    head = report["head_alone"]
    assert head["mode"] == "run pipeline, the fitted head alone (no option scored)" and head["items"] == 6
    assert head["ms_per_item"] > 0 and report["same_labels"]


def json_lines_of(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_head_alone_batches_by_the_tokens_it_feeds(fitted):
    from prefixcache import Classifier
    from prefixcache.data.items import read_items

    out, labelled = fitted
    clf = Classifier(out, progress=False)
    prep = clf.task.prepare(next(read_items(str(labelled))), None)
    assert clf.batching.head_alone and clf.batching.cost(prep) == prep.own_tokens + 1
    scored = Classifier(out, progress=False, prompt_scores=True)
    assert not scored.batching.head_alone and scored.batching.cost(prep) > prep.own_tokens + 1


def test_decide_and_the_server_answer_a_head_alone_pack_without_scoring_an_option(tmp_path, tiny_model_dir):
    """A pack whose every question has a head of the state alone: the decider (what `serve --head`
    and `decide --head` run) feeds no option token, and both wire formats are answered by the
    head (the Decisions route names its questions by their names)."""
    from prefixcache.scoring.options import ScoringOptions
    from prefixcache.serve import decisions
    from prefixcache.serve.decider import Ask, Decider
    from prefixcache.task.head import load_head

    pack = {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "technical": None},
                     "gold": "gold"}}
    spec = write_spec(tmp_path, model=str(tiny_model_dir), system="Route the ticket.", template="{state}", questions=pack)
    rows = [json.loads(line) for line in _labelled(tmp_path / "rows.jsonl", 24).read_text().splitlines()]
    labelled = tmp_path / "states.jsonl"
    labelled.write_text("".join(json.dumps({"id": r["id"], "state": r["text"], "gold": r["gold"]}) + "\n" for r in rows))
    result = invoke("fit", spec, labelled, "-o", tmp_path / "fitted.yaml", "--folds", "3", "-q")
    assert result.exit_code == 0, result.output
    run = {r["id"]: r for r in json_lines_of(invoke("run", tmp_path / "fitted.yaml", labelled, "-q").stdout)}
    head = load_head(str(tmp_path / "fitted.head.safetensors"), tmp_path / "fitted.yaml")
    decider = Decider(str(tiny_model_dir), ScoringOptions.from_environment(device="cpu", dtype="float32"), heads=[head])
    asked = {"team": {k: v for k, v in pack["team"].items() if k != "gold"}}
    system_one = decider.decide([Ask("Route the ticket.", r["text"], asked) for r in rows[:6]])
    body = {"model": "local", "input": [{"role": "system", "content": "Route the ticket."},
                                         {"role": "user", "content": rows[0]["text"]}],
            "questions": [{"type": "choice", "name": "team", "instructions": "Which team?",
                           "choices": [{"value": "billing"}, {"value": "technical"}]}]}
    ask, questions = decisions.parse(body)
    openai = decisions.answer(decider.decide([ask])[0], questions, "local")["answers"][0]
    stem = decider.ready([ask])[0].prep.skips[0]  # the question's text: read (the answer follows it), never scored
    assert decider.engine.label_tokens == 7 * stem  # and no option token went through the model
    for r, got in zip(rows[:6], system_one, strict=True):
        team = got.answers["team"]
        assert team["x_readout"] == "head" and team["choice"] == run[r["id"]]["answers"]["team"]["choice"]
        for option, p in run[r["id"]]["answers"]["team"]["probabilities"].items():
            assert team["probabilities"][option] == pytest.approx(p, abs=1e-5)
    assert openai["name"] == "team" and openai["choice"] == system_one[0].answers["team"]["choice"]
    assert openai["x_readout"] == "head"  # said on both routes
    assert openai["confidence"] == pytest.approx(system_one[0].answers["team"]["confidence"], abs=1e-6)
