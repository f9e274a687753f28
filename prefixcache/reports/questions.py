"""Typed questions evaluated against their gold answers: each question by its own kind's metrics
(choice: accuracy, per-option precision/recall/F1; noul: accuracy at 0.5, Brier, log loss;
score: exact-level accuracy, mean absolute error; calibration error for all), the per-question
gates, and the report files' text. No torch.

An item written as an error record counts as wrong for every question with gold (as a label
task's evaluation counts it), and its answers are left out of the other metrics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..data.records import Record, is_error
from ..task.kind import KINDS, pack_kind
from ..task.questions import Question
from .junit import junit_xml
from .markdown import cell


@dataclass
class QuestionsEvaluation:
    """Gold-answer evaluation of the questions that have gold (`questions`)."""

    questions: Sequence[Question]
    failed: int = 0
    answers: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    golds: dict[str, list[str]] = field(default_factory=dict)
    accuracy_name = "accuracy"

    def add(self, record: Mapping[str, Any]) -> None:
        if is_error(record):
            self.failed += 1
            return
        for q in self.questions:
            self.answers.setdefault(q.id, []).append(record["answers"][q.id])
            self.golds.setdefault(q.id, []).append(record["gold"][q.id])

    def add_failed(self) -> None:
        self.failed += 1

    @property
    def n(self) -> int:
        return self.failed + len(next(iter(self.golds.values()), []))

    def per_question(self) -> dict[str, dict[str, Any]]:
        """Question id -> its type, items and metrics (accuracy over every item, failed ones wrong)."""
        out = {}
        for q in self.questions:
            answers, golds = self.answers.get(q.id, []), self.golds.get(q.id, [])
            figures = pack_kind(q).metrics(q, answers, golds) if answers else {"accuracy": 0.0}
            figures["accuracy"] = figures["accuracy"] * len(answers) / self.n if self.n else 0.0
            out[q.id] = {"type": q.type, "items": self.n, **figures}
        return out

    @property
    def accuracy(self) -> float:
        """The lowest accuracy of any question (what a single --min-accuracy gates)."""
        return min((v["accuracy"] for v in self.per_question().values()), default=0.0)

    def gate_failures(self, gates: Any) -> list[str]:
        out = []
        per = self.per_question()
        for qid, bound in gate_bounds(gates, [q.id for q in self.questions]):
            if per[qid]["accuracy"] < bound:
                out.append(f"accuracy of question {qid!r} {per[qid]['accuracy']:.4f} is below --min-accuracy {bound}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"items": self.n, "failed": self.failed, "questions": self.per_question()}

    def headline(self) -> str:
        parts = [f"{qid} ({v['type']}): " + summary_figures(v) for qid, v in self.per_question().items()]
        return f"{self.n} items · " + " · ".join(parts)

    def to_markdown(self, gates: Any, title: str = "prefixcache evaluation", about: str = "") -> str:
        failures = self.gate_failures(gates)
        stated = bool(gate_bounds(gates, [q.id for q in self.questions]))
        lines = [f"### {title}", ""] + ([about, ""] if about else [])
        lines += [f"{self.n} items, {self.failed} failed" + (f" · gates: **{'FAILED' if failures else 'passed'}**"
                                                            if stated else ""), ""]
        lines += [f"- gate failed: {failure}" for failure in failures] + ([""] if failures else [])
        lines += ["| question | type | accuracy | figures | ECE |", "|---|---|---|---|---|"]
        for qid, v in self.per_question().items():
            lines.append(f"| {cell(qid)} | {v['type']} | {v['accuracy']:.3f} | {cell(kind_figures(v))} | "
                         f"{v.get('ece', 0.0):.3f} |")
        return "\n".join(lines) + "\n"

    def to_junit(self, gates: Any, name: str = "prefixcache", seconds: float = 0.0) -> str:
        """One test case per question, `accuracy[<question id>]`, failing only against a stated gate."""
        bounds = dict(gate_bounds(gates, [q.id for q in self.questions]))
        return junit_xml([(f"accuracy[{qid}]", v["accuracy"], bounds.get(qid), "--min-accuracy")
                          for qid, v in self.per_question().items()], name, seconds)


def gate_bounds(gates: Any, qids: Sequence[str]) -> list[tuple[str, float]]:
    """(question id, least accuracy) for each gated question: a plain --min-accuracy gates every
    question, `--min-accuracy team=0.8` one."""
    per = dict(gates.per_question)
    if gates.min_accuracy is None:
        return list(per.items())
    return [(qid, per.get(qid, gates.min_accuracy)) for qid in qids]


def summary_figures(v: Mapping[str, Any]) -> str:
    return f"accuracy {v['accuracy']:.3f}" + (f", {kind_figures(v)}" if kind_figures(v) else "")


def kind_figures(v: Mapping[str, Any]) -> str:
    """The figures that differ by kind (its `figures`), in words."""
    kind = KINDS.get(str(v.get("type")))
    return kind.figures(v) if kind is not None else ""


def evaluate_questions(questions: Sequence[Question], records: Iterable[Record] = ()) -> QuestionsEvaluation:
    evaluation = QuestionsEvaluation([q for q in questions if q.gold])
    for record in records:
        evaluation.add(record)
    return evaluation


def metrics_json(evaluation: QuestionsEvaluation, gates: Any) -> str:
    return json.dumps({**evaluation.to_json(), "gates_failed": evaluation.gate_failures(gates)}, indent=2) + "\n"
