"""A label spec's labels as its one question: one of the spec's labels, each scored as its name
(or its words) right after the item's prompt, which lists them in the system text. Records keep
the label layout (`label`, `prob`, `margin`, `probs`, `logprobs`, `raw_probs`, `gold`,
`correct`). No torch here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .decision import Decision
from .kind import Asked, Question
from .spec import gold_value

if TYPE_CHECKING:
    from .spec import TaskSpec

QUESTION_ID = "label"
HEAD = ["label", "prob", "margin"]  # the record's fields before the per-label ones


def r6(x: float) -> float:
    return round(x, 6)


class LabelsKind(Asked):
    """The label set of a single-label spec (not a pack type: a spec's `labels:` builds it)."""

    name = "labels"
    abstains = True
    races = True

    def record(self, q: Question, spec: "TaskSpec", fields: Mapping[str, Any], decision: Decision,
               logprobs: Sequence[float] | None) -> dict[str, Any]:
        """The record's fields after the id and the kept input fields."""
        names, best = q.options, decision.best
        record: dict[str, Any] = {"label": None if best is None else names[best],
                  "prob": None if best is None else r6(decision.probs[best]), "margin": r6(decision.margin),
                  "probs": {n: r6(p) for n, p in zip(names, decision.probs)},
                  **({} if logprobs is None else {"logprobs": dict(zip(names, logprobs))})}  # None: a head answered alone
        if decision.raw is not None:
            record["raw_probs"] = {n: r6(p) for n, p in zip(names, decision.raw)}
        if spec.gold:
            gold = gold_value(fields, spec.gold)
            record.update(gold=gold, correct=record["label"] is not None and record["label"] == gold)
        return record

    def question(self, spec: "TaskSpec", options: Sequence[str] = ()) -> Question:
        """The spec's labels as one question: its labels the options, their forms the texts scored."""
        return Question(id=QUESTION_ID, kind=self, instructions="", options=spec.label_names,
                        descriptions=tuple(label.description for label in spec.labels),
                        said=tuple(label.forms for label in spec.labels), normalize=spec.normalize,
                        content_free=spec.content_free, threshold=spec.threshold, gold=spec.gold)

    def prediction(self, q: Question, decision: Decision) -> str | None:
        return None if decision.best is None else q.options[decision.best]

    def columns(self, spec: "TaskSpec") -> tuple[list[str], list[str]]:
        """Its record's CSV columns: those before the per-label ones, and the per-label ones."""
        return per_label_columns(spec, HEAD)

    def table(self, spec: "TaskSpec") -> list[tuple[str, Callable[[Mapping[str, Any]], Any]]]:
        """The columns a table of predictions gets (Classifier), each with how a record fills it."""
        return per_label_table(spec, HEAD)


def per_label_columns(spec: "TaskSpec", head: list[str]) -> tuple[list[str], list[str]]:
    """A label layout's CSV columns: `head`, then per label its probability, its log-probability
    and, calibrated, its raw probability."""
    names = list(spec.label_names)
    per = [f"prob_{n}" for n in names] + [f"logprob_{n}" for n in names]
    return head, per + ([f"raw_prob_{n}" for n in names] if spec.content_free else [])


def per_label_table(spec: "TaskSpec", head: list[str]) -> list[tuple[str, Callable[[Mapping[str, Any]], Any]]]:
    """A label layout's table columns: `head`, then each label's probability."""
    return ([(h, field_of(h)) for h in head] + [(f"prob_{n}", _prob_of(n)) for n in spec.label_names])


def field_of(key: str) -> Callable[[Mapping[str, Any]], Any]:
    """How a table column reads a record's field (None where it has none)."""
    return lambda record: record.get(key)


def _prob_of(label: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda record: record["probs"][label]


LABELS = LabelsKind()

