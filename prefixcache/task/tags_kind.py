"""A multi-label spec's labels as its one question: each label judged on its own by the spec's
question about it, answered yes or no after the item (P(yes) against no), and on when that
reaches the label's threshold. Records keep the multi-label layout (`labels`, `probs`,
`logprobs`, `raw_probs`, `gold`, `correct`). No torch here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .decision import Decision, Tags, judge_tags, log_odds
from .kind import Asked, Question
from .labels_kind import per_label_columns, per_label_table, r6
from .spec import gold_tags

if TYPE_CHECKING:
    from .spec import TaskSpec

QUESTION_ID = "labels"
HEAD = ["labels"]  # the record's fields before the per-label ones


class TagsKind(Asked):
    """The label set of a multi-label spec (not a pack type: `multi_label: true` builds it)."""

    name = "tags"
    races = False  # every label is judged
    judged_each = True  # each label a yes/no call of its own, read where its own answer is scored
    abstains = False  # each label has its own threshold, chosen for F1; the set never abstains as one

    def decide(self, q: Question, logprobs: Sequence[float], counts: Sequence[int],
               unconditional: Sequence[float] = (), prior: Sequence[float] | None = None) -> Tags:
        """`logprobs`: per label, log P(yes) against no (its yes and no branches combined)."""
        return judge_tags(logprobs, q.extra["thresholds"], prior)

    def decision_logs(self, q: Question, decision: Decision | Tags) -> list[tuple[list[float], float | None]]:
        """Each label is a call of its own: its log-odds against its threshold's."""
        return [([log_odds(p)], log_odds(t)) for p, t in zip(decision.probs, q.extra["thresholds"])]

    def record(self, q: Question, spec: "TaskSpec", fields: Mapping[str, Any], tags: Tags,
               logprobs: Sequence[float] | None) -> dict[str, Any]:
        """The record's fields after the id and the kept input fields."""
        names = q.options
        record: dict[str, Any] = {"labels": [n for n, on in zip(names, tags.on) if on],
                  "probs": {n: r6(p) for n, p in zip(names, tags.probs)},
                  **({} if logprobs is None else {"logprobs": dict(zip(names, logprobs))})}  # None: a head answered alone
        if tags.raw is not None:
            record["raw_probs"] = {n: r6(p) for n, p in zip(names, tags.raw)}
        if spec.gold:
            gold = gold_tags(fields, spec.gold, names, spec.gold_sep)
            record.update(gold=gold, correct=gold == record["labels"])
        return record

    def question(self, spec: "TaskSpec", options: Sequence[str] = ()) -> Question:
        """The spec's labels as one multi-label question (each label's yes and no branches are its
        scored texts, combined into P(yes) against no)."""
        return Question(id=QUESTION_ID, kind=self, instructions=spec.question, options=spec.label_names,
                        descriptions=tuple(label.description for label in spec.labels),
                        said=tuple((spec.question_for(label),) for label in spec.labels), normalize="sum",
                        content_free=spec.content_free, gold=spec.gold, extra={"thresholds": spec.tag_thresholds})

    def prediction(self, q: Question, tags: Tags) -> str:
        return " | ".join(n for n, on in zip(q.options, tags.on) if on)

    def columns(self, spec: "TaskSpec") -> tuple[list[str], list[str]]:
        """Its record's CSV columns: those before the per-label ones, and the per-label ones."""
        return per_label_columns(spec, HEAD)

    def table(self, spec: "TaskSpec") -> list[tuple[str, Callable[[Mapping[str, Any]], Any]]]:
        """The columns a table of predictions gets (Classifier), each with how a record fills it."""
        return per_label_table(spec, HEAD)


TAGS = TagsKind()

