"""Typed questions through the command line on a tiny model: records, CSV columns that read back
to the same records, gold per question with its metrics (checked against scikit-learn) and gates,
resume, diff, report, render, and the Python API."""

from __future__ import annotations

import json
import math

import pytest
from helpers import invoke, json_lines, records

from prefixcache.data.output import read_records

PACK = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "invoices", "tech": None,
                                                                         "sales": None}, "gold": "team"},
    "blocked": {"type": "noul", "instructions": "Is the customer blocked?", "gold": "blocked"},
    "mood": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"], "gold": "mood"},
}
TEAMS, MOODS = ["billing", "tech", "sales"], [0, 1, 2]


@pytest.fixture()
def emails(tmp_path):
    path = tmp_path / "emails.jsonl"
    rows = [{"id": f"e{n}", "text": f"message {n} about {TEAMS[n % 3]} and more", "team": TEAMS[(n * 7) % 3],
             "blocked": n % 4 == 0, "mood": MOODS[(n * 5) % 3]} for n in range(9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_run_writes_answers_and_csv_reads_back_to_the_same_records(spec_file, emails, tmp_path):
    spec = spec_file(questions=PACK, system="You read e-mails.")
    out, csv = tmp_path / "out.jsonl", tmp_path / "out.csv"
    assert invoke("run", spec, emails, "-o", out, "-b", 4).exit_code == 0
    assert invoke("run", spec, emails, "-o", csv, "-b", 4, "--keep", "text").exit_code == 0
    got = records(out)
    assert [r["id"] for r in got] == [f"e{n}" for n in range(9)]
    for r in got:
        assert set(r["answers"]) == set(PACK)
        team, blocked, mood = (r["answers"][q] for q in PACK)
        assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
        assert math.isclose(sum(team["probabilities"].values()), 1.0, abs_tol=1e-9)
        assert 0 <= blocked["noul"] <= 1 and "confidence" not in blocked
        assert mood["score"] == pytest.approx(sum(int(k) * p for k, p in mood["probabilities"].items()))
        assert r["gold"]["team"] in TEAMS and set(r["correct"]) == set(PACK)
    header = csv.read_text().splitlines()[0].split(",")
    assert header[:4] == ["id", "text", "team", "team__type"] and "team__p__billing" in header
    assert "mood__legend" in header and "blocked__gold" in header
    back = read_records(str(csv)).records
    for a, b in zip(got, back, strict=True):
        b = {k: v for k, v in b.items() if k not in ("ms", "text")}
        assert b == {**a, "id": str(a["id"])}


def test_metrics_per_question_equal_scikit_learn_and_gates_name_questions(spec_file, emails, tmp_path):
    from sklearn.metrics import accuracy_score, brier_score_loss, f1_score, log_loss, mean_absolute_error

    spec = spec_file(questions=PACK, system="You read e-mails.")
    out, metrics, junit = tmp_path / "out.jsonl", tmp_path / "m.json", tmp_path / "j.xml"
    result = invoke("run", spec, emails, "-o", out, "--metrics", metrics, "--junit", junit,
                    "--min-accuracy", "team=1.0")
    assert result.exit_code == 5 and "accuracy of question 'team'" in result.stderr
    got, figures = records(out), json.loads(metrics.read_text())["questions"]
    team = [r["answers"]["team"]["choice"] for r in got]
    gold_team = [r["gold"]["team"] for r in got]
    assert figures["team"]["accuracy"] == pytest.approx(accuracy_score(gold_team, team))
    seen = sorted(set(team) | set(gold_team))
    assert figures["team"]["macro_f1"] == pytest.approx(f1_score(gold_team, team, labels=seen, average="macro"))
    p_yes = [r["answers"]["blocked"]["noul"] for r in got]
    y = [r["gold"]["blocked"] == "yes" for r in got]
    assert figures["blocked"]["brier"] == pytest.approx(brier_score_loss(y, p_yes))
    assert figures["blocked"]["log_loss"] == pytest.approx(log_loss(y, p_yes, labels=[False, True]))
    assert figures["blocked"]["accuracy"] == pytest.approx(accuracy_score(y, [p >= 0.5 for p in p_yes]))
    score = [r["answers"]["mood"]["score"] for r in got]
    assert figures["mood"]["mae"] == pytest.approx(mean_absolute_error([int(r["gold"]["mood"]) for r in got], score))
    assert 'name="accuracy[team]"' in junit.read_text() and 'failures="1"' in junit.read_text()
    assert invoke("run", spec, emails, "-o", out, "--overwrite", "--min-accuracy", "0").exit_code == 0


def test_gold_from_the_command_line_and_its_refusals(spec_file, emails, tmp_path):
    pack = {q: {k: v for k, v in body.items() if k != "gold"} for q, body in PACK.items()}
    spec = spec_file(questions=pack, system="You read e-mails.")
    out = tmp_path / "out.jsonl"
    assert invoke("run", spec, emails, "-o", out, "--gold", "team=team", "--metrics", tmp_path / "m.json").exit_code == 0
    assert set(records(out)[0]["gold"]) == {"team"}
    for args, message in ((["--gold", "team"], "QUESTION=FIELD"), (["--gold", "colour=team"], "'colour'"),
                          (["--min-accuracy", "team=0.5"], "--min-accuracy needs a gold field"),
                          (["--min-accuracy", "team=2"], "--min-accuracy takes a number in [0, 1]")):
        result = invoke("run", spec, emails, "-o", tmp_path / "x.jsonl", *args)
        assert result.exit_code == 2 and message in result.stderr, result.stderr


WORDS = {**PACK, "team": {**PACK["team"], "words": {"billing": ["billing", "invoices"], "tech": ["tech", "bugs"]}}}


@pytest.mark.parametrize("pack,stop", [(PACK, 4), (WORDS, 3)], ids=["texts", "words-mid-batch"])
def test_an_interrupted_question_run_resumes_to_the_same_records(spec_file, emails, tmp_path, pack, stop):
    spec = spec_file(questions=pack, system="You read e-mails.")
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    assert invoke("run", spec, emails, "-o", whole, "-b", 2).exit_code == 0
    assert invoke("run", spec, emails, "-o", part, "-b", 2, "-n", stop).exit_code == 0
    assert invoke("run", spec, emails, "-o", part, "-b", 2, "--resume").exit_code == 0
    assert records(part) == records(whole)


@pytest.mark.usefixtures("races_of_any_size")
def test_a_pruned_question_run_says_which_options_are_bounds_and_resumes_from_csv(spec_file, emails, tmp_path):
    spec = spec_file(questions=PACK, system="You read e-mails.")
    whole, full, part = tmp_path / "whole.jsonl", tmp_path / "full.jsonl", tmp_path / "part.csv"
    assert invoke("run", spec, emails, "-o", whole, "-b", 2, "--prune", "exact").exit_code == 0
    assert invoke("run", spec, emails, "-o", full, "-b", 2).exit_code == 0
    assert invoke("run", spec, emails, "-o", part, "-b", 2, "-n", 4, "--prune", "exact").exit_code == 0
    assert invoke("run", spec, emails, "-o", part, "-b", 2, "--prune", "exact", "--resume").exit_code == 0
    assert invoke("run", spec, emails, "-o", part, "--prune", "off", "--resume").exit_code != 0  # records would mix
    pruned, every = records(whole), records(full)
    assert all(set(r["pruned"]) <= {"team"} for r in pruned) and all("pruned" not in r for r in every)
    for p, f in zip(pruned, every, strict=True):  # the same answers, every probability within 1e-4
        for qid, answer in p["answers"].items():
            value = answer[answer["type"]]
            assert value == f["answers"][qid][answer["type"]] if answer["type"] == "choice" else \
                abs(value - f["answers"][qid][answer["type"]]) < 1e-4
            assert all(abs(v - f["answers"][qid]["probabilities"][k]) < 1e-4 for k, v in answer.get("probabilities", {}).items())
    back = read_records(str(part)).records
    assert [{k: v for k, v in b.items() if k != "ms"} for b in back] == [
        {**{k: v for k, v in a.items() if k != "ms"}, "id": str(a["id"])} for a in pruned]


def test_diff_and_render_speak_per_question(spec_file, emails, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert invoke("run", spec_file(questions=PACK, system="You read e-mails."), emails, "-o", a).exit_code == 0
    calibrated = {**PACK, "team": {**PACK["team"], "calibrate": True}}
    assert invoke("run", spec_file("b.yaml", questions=calibrated, system="You read e-mails."), emails, "-o", b).exit_code == 0
    result = invoke("diff", a, b, "--json", tmp_path / "d.json")
    assert result.exit_code == 0 and "question team" in result.stdout and "question mood" in result.stdout
    per = json.loads((tmp_path / "d.json").read_text())["questions"]
    assert set(per) == set(PACK) and per["blocked"]["changed"] == 0  # only team is calibrated
    rendered = invoke("render", spec_file(questions=PACK, system="x"), emails, "--limit", 1)
    lines = [json.loads(line) for line in rendered.stdout.splitlines()]
    assert [line["question"] for line in lines] == list(PACK)
    assert set(lines[0]["candidates"]) == {"billing", "tech", "sales"} and lines[2]["type"] == "score"


def test_the_classifier_answers_strings_and_tables(tiny_model_dir):
    import pandas as pd

    from prefixcache import Classifier

    pack = {q: {k: v for k, v in body.items() if k != "gold"} for q, body in PACK.items()}
    clf = Classifier(model=str(tiny_model_dir), system="You read e-mails.", questions=pack, progress=False)
    answers = clf("the app crashes")
    assert set(answers) == set(PACK) and answers["team"]["type"] == "choice"
    table = clf.classify_df(pd.DataFrame({"text": ["a bill", "a crash", ""]}))
    assert {"team", "team__p__tech", "blocked", "mood__confidence", "error"} <= set(table.columns)
    assert table["team"].iloc[0] in TEAMS and pd.isna(table["team"].iloc[2]) and table["error"].iloc[2]
    with pytest.raises(Exception, match="candidate_labels"):
        clf("x", candidate_labels=["a", "b"])


def test_tune_refuses_a_question_spec(spec_file, emails, tmp_path):
    spec = spec_file(questions=PACK, system="x")
    tuned = invoke("tune", spec, emails)
    assert tuned.exit_code == 2 and "typed questions" in tuned.stderr
    assert json_lines  # (helpers imported for other files' shape)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_shards_of_a_question_run_merge_into_the_whole(spec_file, emails, tmp_path, fmt):
    spec = spec_file(questions=PACK, system="You read e-mails.")
    whole = tmp_path / f"whole.{fmt}"
    assert invoke("run", spec, emails, "-o", whole, "-b", 2).exit_code == 0
    parts = [tmp_path / f"part{k}.{fmt}" for k in (1, 2)]
    for k, part in enumerate(parts, 1):
        assert invoke("run", spec, emails, "-o", part, "-b", 2, "--shard", f"{k}/2").exit_code == 0
    merged = tmp_path / f"merged.{fmt}"
    assert invoke("merge", *parts, "-o", merged).exit_code == 0

    def answers(path):
        return [(r["id"], r["answers"], r.get("gold")) for r in read_records(str(path)).records]

    assert answers(merged) == answers(whole)


def test_one_answer_for_most_items_is_warned_of_per_question(spec_file, tmp_path):
    same = tmp_path / "same.jsonl"  # the same text: every item gets the same answers
    same.write_text("".join(json.dumps({"id": n, "text": "one and the same e-mail"}) + "\n" for n in range(21)))
    result = invoke("run", spec_file(questions=PACK, system="x"), same, "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 2  # the items lack the gold fields the pack names
    pack = {q: {k: v for k, v in body.items() if k != "gold"} for q, body in PACK.items()}
    result = invoke("run", spec_file(questions=pack, system="x"), same, "-o", tmp_path / "o.jsonl")
    assert result.exit_code == 0
    assert "100% of the items (21 of 21) got" in result.stderr and "for question 'team'" in result.stderr
    assert "for question 'blocked'" in result.stderr and "for question 'mood'" not in result.stderr
    assert "try 'calibrate: true' on the question" in result.stderr
    calibrated = invoke("run", spec_file("c.yaml", questions=pack, system="x", calibrate=True), same, "-o",
                        tmp_path / "c.jsonl")
    assert calibrated.exit_code == 0 and "for question 'team'" in calibrated.stderr
    assert "try 'calibrate" not in calibrated.stderr and "it is calibrated already" in calibrated.stderr
