"""A new kind of question is one module: a kind defined here, and registered, goes through the
spec, the prompt, scoring, records, CSV, metrics and render with nothing else changed, and its
numbers are those of the same question asked as a `choice`."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

import pytest
from helpers import invoke, records

from prefixcache.data.output import read_records
from prefixcache.errors import SpecError
from prefixcache.task.choice_kind import ChoiceKind
from prefixcache.task.decision import Decision
from prefixcache.task.kind import KINDS, Asked, Question, choice_confidence, distribution_answer
from prefixcache.task.scoring_metrics import per_class

LEVELS = ("disagree", "unsure", "agree")


class LikertKind(Asked):
    """A statement the text agrees with or not, on a fixed three-point scale."""

    name = "likert"
    aliases: tuple[str, ...] = ()

    def parse(self, qid: str, entry: Mapping[str, Any], at: str) -> dict[str, Any]:
        if entry.get("criteria") is not None:
            raise SpecError(f"{at}: a likert question's scale is fixed; it takes no 'criteria'")
        return dict(options=LEVELS, descriptions=(None,) * 3, said=tuple((level,) for level in LEVELS))

    def branch(self, q: Question) -> str:  # the text a choice question with these options shows
        return f"{q.instructions}\nAnswer with exactly one of these options:\n" + "\n".join(f"- {o}" for o in q.options)

    def option_of(self, q: Question, value: Any) -> str | None:
        return value if value in LEVELS else None

    def accepted(self, q: Question) -> tuple[str, ...]:
        return LEVELS

    def answer(self, q: Question, decision: Decision, logprobs: Sequence[float]) -> dict[str, Any]:
        return distribution_answer(q, decision, logprobs, {"type": "likert", "likert": q.options[decision.best],
                                                           "confidence": choice_confidence(decision.probs)})

    def value_of(self, cell: str) -> Any:
        return cell

    def distribution(self, answer: Mapping[str, Any]) -> dict[str, float]:
        return dict(answer["probabilities"])

    def summary(self, answer: Mapping[str, Any]) -> str:
        return answer["likert"]

    def correct(self, q: Question, answer: Mapping[str, Any], gold: str) -> bool | None:
        return answer["likert"] == gold

    def columns(self, q: Question) -> list[str]:
        return ["confidence"] + [f"p__{o}" for o in q.options] + [f"lp__{o}" for o in q.options]

    def metrics(self, q: Question, answers: Sequence[Mapping[str, Any]], golds: Sequence[str]) -> dict[str, Any]:
        return per_class(q.options, [a["likert"] for a in answers], golds)

    def figures(self, metrics: Mapping[str, Any]) -> str:
        return f"macro-F1 {metrics['macro_f1']:.3f}"


@pytest.fixture()
def likert(monkeypatch):
    monkeypatch.setitem(KINDS, "likert", LikertKind())


@pytest.fixture()
def statements(tmp_path):
    path = tmp_path / "items.jsonl"
    rows = [{"id": f"s{n}", "text": f"message {n}: the refund came {'late' if n % 2 else 'on time'}",
             "stance": LEVELS[n % 3], "blocked": n % 2 == 0} for n in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_new_kind_runs_end_to_end_and_scores_as_the_same_choice_question(likert, spec_file, statements, tmp_path):
    said = "Does the writer agree that refunds are slow?"
    pack = {"stance": {"type": "likert", "instructions": said, "gold": "stance"},
            "blocked": {"type": "noul", "instructions": "Is the customer blocked?", "gold": "blocked"}}
    spec = spec_file(questions=pack, system="You read messages.")
    out, csv, metrics, md = tmp_path / "out.jsonl", tmp_path / "out.csv", tmp_path / "m.json", tmp_path / "s.md"
    result = invoke("run", spec, statements, "-o", out, "--metrics", metrics, "--summary-md", md)
    assert result.exit_code == 0, result.output
    assert invoke("run", spec, statements, "-o", csv).exit_code == 0
    got = records(out)
    for r in got:
        stance = r["answers"]["stance"]
        assert stance["type"] == "likert" and stance["likert"] == max(stance["probabilities"],
                                                                      key=stance["probabilities"].get)
        assert math.isclose(sum(stance["probabilities"].values()), 1.0, abs_tol=1e-9)
        assert r["gold"]["stance"] in LEVELS and isinstance(r["correct"]["stance"], bool)
    back = read_records(str(csv)).records
    assert [{k: v for k, v in b.items() if k != "ms"} for b in back] == [
        {**{k: v for k, v in a.items() if k != "ms"}, "id": str(a["id"])} for a in got]
    figures = json.loads(metrics.read_text())["questions"]["stance"]
    assert figures["type"] == "likert" and figures["accuracy"] == pytest.approx(
        sum(r["correct"]["stance"] for r in got) / len(got))

    # the same question as a choice (same prompt text, same options): the same numbers
    as_choice = spec_file(name="choice.yaml", system="You read messages.", questions={
        "blocked": pack["blocked"], "stance": {"type": "choice", "instructions": said,
                                               "criteria": {level: None for level in LEVELS}}})
    plain = tmp_path / "choice.jsonl"
    assert invoke("run", as_choice, statements, "-o", plain).exit_code == 0
    for a, b in zip(got, records(plain), strict=True):
        for level in LEVELS:
            assert a["answers"]["stance"]["probabilities"][level] == pytest.approx(
                b["answers"]["stance"]["probabilities"][level], abs=1e-5)
        assert a["answers"]["blocked"]["noul"] == pytest.approx(b["answers"]["blocked"]["noul"], abs=1e-5)

    rendered = invoke("render", spec, statements, "--limit", "1")
    assert rendered.exit_code == 0 and {json.loads(line)["type"] for line in rendered.stdout.splitlines()} == {
        "likert", "noul"}
    assert "| stance | likert |" in md.read_text() and "macro-F1" in md.read_text()


def test_a_new_kinds_own_checks_refuse_a_pack_before_the_model_loads(likert, spec_file, statements, tmp_path):
    spec = spec_file(questions={"stance": {"type": "likert", "instructions": "Agree?", "criteria": {"a": None}}})
    result = invoke("run", spec, statements, "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "question 'stance': a likert question's scale is fixed" in result.stderr
    assert ChoiceKind.races and not LikertKind.races  # a kind that says nothing is scored to the end
