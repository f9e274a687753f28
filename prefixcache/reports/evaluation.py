"""Gold-label evaluation, accumulated record by record (memory does not grow with the items).
Multi-label tasks have their own (`TagEvaluation`); both carry the gates and the JUnit report.

Accuracy counts an abstention (label null) and an item that could not be scored (an error
record) as wrong; coverage is the share of items that got a label.
Per-label precision, recall, F1 and the confusion matrix are kept for label tasks; for multiple
choice, whose options differ per item, accuracy is the measure.
"""

from __future__ import annotations

import math

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Sequence, Union, overload

from .. import safefile
from ..errors import OutputError, UsageError
from ..data.records import Record, is_error
from ..task.spec import TaskSpec
from .junit import junit_xml
from .markdown import cell
from .questions import QuestionsEvaluation, evaluate_questions

ABSTAIN = "(abstained)"
CALIBRATION_BINS = 10


def _binned(bins: list, prob: float, right: bool) -> None:
    b = bins[min(int(prob * CALIBRATION_BINS), CALIBRATION_BINS - 1)]
    b[0], b[1], b[2] = b[0] + 1, b[1] + prob, b[2] + right


def _ece(bins: list) -> float:
    items = sum(b[0] for b in bins)
    return sum(abs(b[2] - b[1]) for b in bins if b[0]) / items if items else 0.0



class Gated:
    """What both evaluations share: the count of items, the right ones and the failed ones,
    calibration bins, the gates and the JUnit report (on a `per_label()` table with recall and
    `to_json()`)."""

    n: int
    correct: int
    failed: int
    bins: list  # [items, summed confidence, right] per equal-width confidence bin
    accuracy_name = "accuracy"  # what --min-accuracy gates, in words

    def add_failed(self) -> None:
        self.n += 1
        self.failed += 1

    def per_label(self) -> dict[str, dict[str, float]]:
        """Per label: its precision, recall, F1 and support."""
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """Its figures as JSON (the metrics file)."""
        raise NotImplementedError

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def ece(self) -> float:
        """Expected calibration error: mean |accuracy - confidence| over equal-width confidence
        bins, weighted by their items (items with a prediction only)."""
        return _ece(self.bins)

    def gate_failures(self, gates: "Gates") -> list[str]:
        """One line per gate this evaluation misses."""
        out = []
        if gates.min_accuracy is not None and self.accuracy < gates.min_accuracy:
            out.append(f"{self.accuracy_name} {self.accuracy:.4f} is below --min-accuracy {gates.min_accuracy}")
        if gates.min_recall is not None:
            out += [f"recall of {label!r} {st['recall']:.4f} is below --min-recall {gates.min_recall}"
                    for label, st in self.per_label().items() if st["recall"] < gates.min_recall]
        if gates.min_answered is not None:
            correct, answered = self.answered_record()
            low = exact_lower_bound(correct, answered)
            if low < gates.min_answered:
                out.append(f"the answered items' accuracy {correct}/{answered} has a 95% lower bound of {low:.4f}, "
                           f"below --min-answered-accuracy {gates.min_answered}")
        return out

    def answered_record(self) -> tuple[int, int]:
        """(right, answered) among the items with gold that were answered (not abstained, not failed)."""
        return 0, 0

    def answered_figures(self) -> dict[str, float]:
        """The answered items' accuracy and its exact 95% lower bound (none when nothing was answered)."""
        right, answered = self.answered_record()
        if not answered:
            return {}
        return {"answered_accuracy": right / answered,
                "answered_accuracy_low": round(exact_lower_bound(right, answered), 6)}

    def to_junit(self, gates: "Gates", name: str = "prefixcache", seconds: float = 0.0) -> str:
        """A JUnit XML report with stable test names (CI history follows them from run to run):
        "accuracy" and one "recall[<label>]" per label. A case fails only against a stated gate
        (--min-accuracy, --min-recall); its value is in the case's output and the properties."""
        checks = [("accuracy", self.accuracy, gates.min_accuracy, "--min-accuracy")]
        checks += [(f"recall[{label}]", st["recall"], gates.min_recall, "--min-recall")
                   for label, st in self.per_label().items()]
        return junit_xml(checks, name, seconds, {k: v for k, v in self.to_json().items() if not isinstance(v, dict)})


def exact_lower_bound(correct: int, n: int, confidence: float = 0.95) -> float:
    """The one-sided exact (Clopper-Pearson) lower bound of a proportion `correct`/`n`: the p at
    which P(X >= correct | n, p) = 1 - confidence, by bisection on the binomial tail (no scipy)."""
    if n == 0 or correct == 0:
        return 0.0
    alpha = 1 - confidence

    def tail(p: float) -> float:  # P(X >= correct), summed in logs
        logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
                + (n - i) * math.log1p(-p) for i in range(correct, n + 1)]
        top = max(logs)
        return math.exp(top) * sum(math.exp(v - top) for v in logs)

    low, high = 0.0, correct / n
    for _ in range(60):
        mid = (low + high) / 2
        if tail(mid) < alpha:
            low = mid
        else:
            high = mid
    return low


@dataclass
class Evaluation(Gated):
    labels: Sequence[str] | None  # None for multiple choice
    n: int = 0
    correct: int = 0
    abstained: int = 0
    failed: int = 0  # items written as error records
    bins: list = field(default_factory=lambda: [[0, 0.0, 0] for _ in range(CALIBRATION_BINS)])  # [items, confidence, correct]
    confusion: Counter = field(default_factory=Counter)  # (gold, predicted) -> count
    bounded: int = 0  # records with labels pruned scoring left at a bound (their decision exact)

    def answered_record(self) -> tuple[int, int]:
        return self.correct, self.n - self.abstained - self.failed

    def add(self, gold: str, predicted: str | None, correct: bool | None = None, prob: float | None = None) -> None:
        """One item: its gold value and prediction (`correct` when the record decided it, e.g. a
        gold letter naming the option predicted), and the prediction's probability (calibration)."""
        right = (predicted == gold) if correct is None else bool(correct)
        self.n += 1
        self.correct += right
        if prob is not None:
            _binned(self.bins, prob, right)
        self.abstained += predicted is None
        if self.labels is not None:
            self.confusion[(gold, ABSTAIN if predicted is None else predicted)] += 1



    @property
    def coverage(self) -> float:
        return 1 - (self.abstained + self.failed) / self.n if self.n else 0.0

    def per_label(self) -> dict[str, dict[str, float]]:
        out = {}
        for label in self.labels or ():
            tp = self.confusion[(label, label)]
            predicted = sum(c for (g, p), c in self.confusion.items() if p == label)
            support = sum(c for (g, p), c in self.confusion.items() if g == label)
            precision = tp / predicted if predicted else 0.0
            recall = tp / support if support else 0.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            out[label] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
        return out

    @property
    def macro_f1(self) -> float | None:
        if self.labels is None:
            return None
        stats = self.per_label()
        return sum(s["f1"] for s in stats.values()) / len(stats) if stats else 0.0

    def matrix(self) -> tuple[list[str], list[list[int]]]:
        """Rows: gold labels; columns: predicted labels (plus abstentions when there are any)."""
        labels = list(self.labels or ())
        columns = labels + ([ABSTAIN] if self.abstained else [])
        return columns, [[self.confusion[(g, p)] for p in columns] for g in labels]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "items": self.n, "correct": self.correct, "accuracy": self.accuracy,
            "abstained": self.abstained, "failed": self.failed, "coverage": self.coverage, "ece": self.ece,
        }
        if self.abstained:  # an abstaining head: what its answers are worth, with its exact bound
            data.update(self.answered_figures())
        if self.bounded:
            data["items_with_pruned_labels"] = self.bounded  # their decision is full scoring's
        if self.labels is not None:
            columns, rows = self.matrix()
            data.update(macro_f1=self.macro_f1, per_label=self.per_label(),
                        confusion={"labels": list(self.labels), "predicted": columns, "matrix": rows})
        return data

    def to_markdown(self, gates: "Gates", title: str = "prefixcache evaluation", about: str = "") -> str:
        """A CI step summary: the figures, each gate missed (with its threshold and the value), and
        `about` (which spec, model and input) under the title."""
        stated = gates.min_accuracy is not None or gates.min_recall is not None
        failures = self.gate_failures(gates)
        gate = f" · gates: **{'FAILED' if failures else 'passed'}**" if stated else ""
        lines = [f"### {title}", ""] + ([about, ""] if about else [])
        lines += [f"accuracy **{self.accuracy:.3f}** ({self.correct}/{self.n}) · coverage {self.coverage:.3f}"
                  + (f" · macro-F1 {self.macro_f1:.3f}" if self.labels is not None else "") + gate, ""]
        lines += [f"- gate failed: {failure}" for failure in failures] + ([""] if failures else [])
        if self.bounded:
            lines += [f"{self.bounded} items had labels pruned (the decision is exact; the probabilities within 1e-4 "
                      f"with --prune exact, lower bounds for the labels scored to the end with --prune on)", ""]
        if self.labels is not None:
            lines += ["| label | precision | recall | F1 | support |", "|---|---|---|---|---|"]
            lines += [f"| {cell(k)} | {v['precision']:.3f} | {v['recall']:.3f} | {v['f1']:.3f} | {v['support']} |"
                      for k, v in self.per_label().items()]
            columns, rows = self.matrix()
            lines += ["", "| gold \\\\ predicted | " + " | ".join(map(cell, columns)) + " |", "|---" * (len(columns) + 1) + "|"]
            lines += [f"| {cell(g)} | " + " | ".join(map(str, row)) + " |" for g, row in zip(self.labels, rows)]
        return "\n".join(lines) + "\n"

def _prf(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return precision, recall, 2 * precision * recall / (precision + recall) if precision + recall else 0.0


@dataclass
class TagEvaluation(Gated):
    """Multi-label evaluation: per label a yes/no decision against the gold set.

    accuracy is exact-set accuracy (the labels on are exactly the gold ones; an error record is
    wrong); precision, recall and F1 per label, micro (pooled over every item and label) and
    macro (the mean over labels); Hamming loss is the share of (item, label) decisions that are
    wrong, over the items scored. Calibration bins pool every label's P(yes), and are kept per
    label too."""

    labels: Sequence[str]
    n: int = 0
    correct: int = 0  # items whose labels are exactly the gold set
    failed: int = 0
    counts: dict = field(default_factory=dict)  # label -> [tp, fp, fn, tn]
    bins: list = field(default_factory=lambda: [[0, 0.0, 0] for _ in range(CALIBRATION_BINS)])
    label_bins: dict = field(default_factory=dict)  # label -> bins like `bins`
    accuracy_name = "exact-set accuracy"
    abstained = 0  # a multi-label item never abstains: no label on is a decision

    def __post_init__(self) -> None:
        self.counts = {label: [0, 0, 0, 0] for label in self.labels}
        self.label_bins = {label: [[0, 0.0, 0] for _ in range(CALIBRATION_BINS)] for label in self.labels}

    def add(self, gold: Sequence[str], predicted: Sequence[str], probs: dict[str, float] | None = None) -> None:
        self.n += 1
        self.correct += set(gold) == set(predicted)
        for label in self.labels:
            truth, on = label in gold, label in predicted
            self.counts[label][(0 if truth else 1) if on else (2 if truth else 3)] += 1
            if probs and label in probs:
                p = float(probs[label])
                for bins in (self.bins, self.label_bins[label]):
                    _binned(bins, p, truth)


    @property
    def coverage(self) -> float:
        return 1 - self.failed / self.n if self.n else 0.0

    @property
    def hamming_loss(self) -> float:
        scored = self.n - self.failed
        wrong = sum(c[1] + c[2] for c in self.counts.values())
        return wrong / (scored * len(self.labels)) if scored and self.labels else 0.0


    def per_label(self) -> dict[str, dict[str, float]]:
        out = {}
        for label, (tp, fp, fn, _) in self.counts.items():
            precision, recall, f1 = _prf(tp, fp, fn)
            out[label] = {"precision": precision, "recall": recall, "f1": f1, "support": tp + fn}
        return out

    def micro(self) -> tuple[float, float, float]:
        """Precision, recall and F1 pooled over every (item, label)."""
        return _prf(*(sum(c[k] for c in self.counts.values()) for k in range(3)))

    def macro(self) -> tuple[float, float, float]:
        """Precision, recall and F1, each the mean over labels."""
        stats = self.per_label().values()
        p, r, f = (sum(st[k] for st in stats) / len(stats) if stats else 0.0 for k in ("precision", "recall", "f1"))
        return p, r, f

    @property
    def macro_f1(self) -> float:
        return self.macro()[2]

    def to_json(self) -> dict[str, Any]:
        micro, macro = self.micro(), self.macro()
        return {
            "items": self.n, "correct": self.correct, "accuracy": self.accuracy, "accuracy_is": "exact-set",
            "failed": self.failed, "coverage": self.coverage, "ece": self.ece, "hamming_loss": self.hamming_loss,
            "micro_precision": micro[0], "micro_recall": micro[1], "micro_f1": micro[2],
            "macro_precision": macro[0], "macro_recall": macro[1], "macro_f1": macro[2],
            "per_label": self.per_label(),
        }

    def headline(self) -> str:
        micro, macro = self.micro(), self.macro()
        return (f"exact-set accuracy {self.accuracy:.3f} ({self.correct}/{self.n}) · Hamming loss {self.hamming_loss:.3f} · "
                f"micro-F1 {micro[2]:.3f} · macro-F1 {macro[2]:.3f}"
                + (f" · {self.failed} failed" if self.failed else ""))

    def to_markdown(self, gates: "Gates", title: str = "prefixcache evaluation", about: str = "") -> str:
        stated = gates.min_accuracy is not None or gates.min_recall is not None
        failures = self.gate_failures(gates)
        gate = f" · gates: **{'FAILED' if failures else 'passed'}**" if stated else ""
        lines = [f"### {title}", ""] + ([about, ""] if about else []) + [self.headline() + gate, ""]
        lines += [f"- gate failed: {failure}" for failure in failures] + ([""] if failures else [])
        lines += ["| label | precision | recall | F1 | support |", "|---|---|---|---|---|"]
        lines += [f"| {cell(k)} | {v['precision']:.3f} | {v['recall']:.3f} | {v['f1']:.3f} | {v['support']} |"
                  for k, v in self.per_label().items()]
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Gates:
    """Thresholds a CI run must meet (None: not checked)."""

    min_accuracy: float | None = None
    min_recall: float | None = None  # for every label
    per_question: tuple[tuple[str, float], ...] = ()  # typed questions: (question id, least accuracy)
    min_answered: float | None = None  # the answered items' accuracy, its exact 95% lower bound (an audit)

    @classmethod
    def parse(cls, min_accuracy: float | str | None, min_recall: float | None = None,
              min_answered: float | None = None) -> "Gates":
        """The gates from the options: --min-accuracy is a number (every question, or the label
        task's accuracy) or QUESTION=NUMBER pairs separated by commas."""
        if min_accuracy is None or isinstance(min_accuracy, (int, float)):
            return cls(min_accuracy, min_recall, min_answered=min_answered)
        plain, per = None, []
        for part in str(min_accuracy).split(","):
            name, _, value = part.rpartition("=")
            try:
                bound = float(value)
            except ValueError:
                bound = -1.0
            if not 0 <= bound <= 1 or (not name and "=" in part):
                raise UsageError(f"--min-accuracy takes a number in [0, 1], or QUESTION=NUMBER pairs separated by "
                                 f"commas; got {part!r}")
            if name:
                per.append((name.strip(), bound))
            else:
                plain = bound
        return cls(plain, min_recall, tuple(per), min_answered)

    def check(self, spec: TaskSpec) -> None:
        """Refuse gates that name no question of the spec (or name one in a label task)."""
        if self.min_answered is not None and (spec.questions or spec.multi_label):
            raise UsageError("--min-answered-accuracy applies to a label set or multiple choice (a spec without "
                             "'questions' or 'multi_label')")
        qids = [q.id for q in spec.questions if q.gold]
        for qid, _ in self.per_question:
            if not spec.questions:
                raise UsageError(f"--min-accuracy {qid}=...: naming a question applies to specs with 'questions'")
            if qid not in qids:
                raise UsageError(f"--min-accuracy names {qid!r}, which is not a question with gold "
                                 f"({', '.join(map(repr, qids)) or 'none has gold'})")
        if spec.questions and self.min_recall is not None:
            raise UsageError("--min-recall applies to label tasks; gate questions with --min-accuracy QUESTION=NUMBER")


AnyEvaluation = Union[Evaluation, TagEvaluation, QuestionsEvaluation]  # what a run's gold gives


def evaluation_for(spec: TaskSpec, records: Iterable[Record] = ()) -> AnyEvaluation | None:
    """An Evaluation for a task spec, holding `records` already written (error records are left
    out); None when the spec has no gold field."""
    if spec.questions:
        return evaluate_questions(spec.questions, records) if spec.has_gold else None
    if not spec.gold:
        return None
    return evaluate(None if spec.choices else spec.label_names, records, spec.multi_label)


@overload
def evaluate(labels: Sequence[str] | None, records: Iterable[Record] = (), tags: Literal[False] = False) -> Evaluation: ...
@overload
def evaluate(labels: Sequence[str] | None, records: Iterable[Record], tags: Literal[True]) -> TagEvaluation: ...
@overload
def evaluate(labels: Sequence[str] | None, records: Iterable[Record] = (), tags: bool = False
             ) -> Evaluation | TagEvaluation: ...
def evaluate(labels: Sequence[str] | None, records: Iterable[Record] = (), tags: bool = False
             ) -> Evaluation | TagEvaluation:
    """An Evaluation of written records (labels None: multiple choice; `tags`: multi-label)."""
    evaluation = TagEvaluation(labels or ()) if tags else Evaluation(labels)
    for record in records:
        add_record(evaluation, record)
    return evaluation


def add_record(evaluation: AnyEvaluation, record: Record) -> None:
    if isinstance(evaluation, QuestionsEvaluation):
        evaluation.add(record)
    elif is_error(record):
        evaluation.add_failed()
    elif isinstance(evaluation, TagEvaluation):
        evaluation.add(record["gold"], record["labels"], record.get("probs"))
    else:
        evaluation.add(str(record["gold"]), record["label"] or None, record.get("correct"), record.get("prob"))
        evaluation.bounded += bool(record.get("pruned"))


def write_report_file(path: Path, text: str, append: bool = False) -> None:
    """A report file written (or, with `append`, added to as CI step summaries are)."""
    if not append:
        safefile.replace(path, text, what="the report")
        return
    stream = safefile.append(path, what="the report")
    try:
        with stream:
            stream.write(text)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the report: {exc.strerror}")


def write_reports(evaluation: AnyEvaluation, metrics: Optional[Path], summary_md: Optional[Path], junit: Optional[Path],
                  gates: Gates, seconds: float = 0.0, about: str = "") -> None:
    """The report files asked for: JSON metrics, a Markdown summary (appended; `about` says which
    spec, model and input), a JUnit XML report."""
    if metrics:
        figures = {**evaluation.to_json(), "min_accuracy": gates.min_accuracy, "min_recall": gates.min_recall,
                   "gates_failed": evaluation.gate_failures(gates)}
        if gates.min_answered is not None and isinstance(evaluation, Gated):  # an audit: its figures even where none abstained
            figures.update(evaluation.answered_figures(), min_answered_accuracy=gates.min_answered)
        write_report_file(metrics, json.dumps(figures, indent=2) + "\n")
    if summary_md:
        write_report_file(summary_md, evaluation.to_markdown(gates, about=about), append=True)  # as CI step summaries do
    if junit:
        write_report_file(junit, evaluation.to_junit(gates, seconds=seconds))
