"""A multiple-choice spec's question: one of the item's own options, each scored as its text
(or, with `score_by: letter`, its letter) right after the item's prompt. Records keep the
multiple-choice layout (`label`, `index`, `scored`, `prob`, `margin`, `probs` and `logprobs` as
lists in option order, `gold`, `correct`). No torch here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .decision import Decision, judge
from .kind import Asked, Question
from .labels_kind import field_of, r6
from .spec import LETTERS, gold_value, option_of

if TYPE_CHECKING:
    from .spec import TaskSpec

QUESTION_ID = "choice"


class OptionsKind(Asked):
    """An item's own options (not a pack type: a spec's `choices:` field builds it per item)."""

    name = "options"
    abstains = True

    def decide(self, q: Question, logprobs: Sequence[float], counts: Sequence[int],
               unconditional: Sequence[float] = (), prior: Sequence[float] | None = None) -> Decision:
        """As the default, but `chars` and `bytes` divide by the option's text, letters scored or not."""
        return judge(list(logprobs), q.normalize, counts, list(q.options), list(unconditional), prior, q.threshold)

    def record(self, q: Question, spec: "TaskSpec", fields: Mapping[str, Any], decision: Decision,
               logprobs: Sequence[float] | None) -> dict[str, Any]:
        """The record's fields after the id and the kept input fields."""
        names, best = list(q.options), decision.best
        record: dict[str, Any] = {"label": None if best is None else names[best], "index": best, "scored": spec.score_by,
                  "prob": None if best is None else r6(decision.probs[best]), "margin": r6(decision.margin),
                  "probs": [r6(p) for p in decision.probs], "logprobs": None if logprobs is None else list(logprobs)}
        if spec.gold:
            gold = gold_value(fields, spec.gold)
            meant = option_of(gold, names)  # a letter names an option
            record.update(gold=gold, correct=record["label"] is not None and record["label"] == meant)
        return record

    def question(self, spec: "TaskSpec", options: Sequence[str] = ()) -> Question:
        """An item's options as its one question: scored as their texts, or as letters."""
        said = (tuple((LETTERS[i],) for i in range(len(options))) if spec.score_by == "letter"
                else tuple((o,) for o in options))
        return Question(id=QUESTION_ID, kind=self, instructions="", options=tuple(options),
                        descriptions=(None,) * len(options), said=said, normalize=spec.normalize,
                        threshold=spec.threshold, gold=spec.gold)

    def prediction(self, q: Question, decision: Decision) -> str | None:
        return None if decision.best is None else q.options[decision.best]

    def columns(self, spec: "TaskSpec") -> tuple[list[str], list[str]]:
        """Its record's CSV columns: the fields before the option lists, and the lists (JSON in a cell)."""
        return ["label", "index", "scored", "prob", "margin"], ["probs", "logprobs"]

    def table(self, spec: "TaskSpec") -> list[tuple[str, Callable[[Mapping[str, Any]], Any]]]:
        """The columns a table of predictions gets (Classifier), each with how a record fills it."""
        return [(h, field_of(h)) for h in ("label", "prob", "margin", "index", "probs")]


OPTIONS = OptionsKind()

