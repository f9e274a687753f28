"""Decision rules and what they decide, as arrays over the labelled items. No torch.

A rule is a normalisation and calibration on or off (`Rule`), and a threshold: the spec's, or one
fitted on labelled items (`Config.fitted`). One scoring pass of a prompt gives, per rule, each
item's best candidate and its probability (or, multi-label, each label's probability): a
`Decided`. A threshold turns that into an `Outcome`: per item right or wrong, answered or not, and
per label said and true, from which every figure of the leaderboard is a weighted sum (`figures`:
the weights are 1 for the figures themselves, bootstrap counts for their intervals).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..task.decision import NORMALIZATIONS
from ..task.decision import DEFAULT_CONTENT_FREE
from ..task.spec import TaskSpec, choice_list, gold_tags, gold_value, option_of

GRID = tuple(round(0.05 * k, 2) for k in range(1, 20))  # thresholds a fitted one is chosen from


@dataclass(frozen=True)
class Rule:
    """How label scores become a decision: the normalisation and whether it is calibrated."""

    normalize: str = "sum"
    calibrate: bool = False

    def apply(self, spec: TaskSpec) -> TaskSpec:
        """`spec` deciding by this rule, with no threshold (tune applies its own); a calibrated
        rule keeps the spec's own content-free inputs when it names some."""
        content_free = (spec.content_free or DEFAULT_CONTENT_FREE) if self.calibrate else ()
        return dataclasses.replace(spec, normalize=self.normalize, content_free=content_free, threshold=None)

    @property
    def name(self) -> str:
        return self.normalize + ("+calibrated" if self.calibrate else "")


def rules_for(spec: TaskSpec) -> list[Rule]:
    """The rules a task can decide by: every normalisation, calibrated or not (multiple choice is
    not calibrated; a multi-label task compares yes with no, so its normalisation is sum)."""
    if spec.multi_label:
        return [Rule("sum", False), Rule("sum", True)]
    return [Rule(norm, calibrate) for calibrate in (False, True) if not (calibrate and spec.choices)
            for norm in NORMALIZATIONS]


def spec_rule(spec: TaskSpec) -> Rule:
    return Rule(spec.normalize, bool(spec.content_free))


@dataclass(frozen=True)
class Gold:
    """The labelled items' gold values: per item the index of its gold label (or of the option it
    names); multi-label: per item and label, whether the label applies. `labels`: the task's
    labels (empty for multiple choice, whose options differ per item)."""

    labels: tuple[str, ...]
    index: np.ndarray  # [items] int; multi-label: unused (-1)
    tags: np.ndarray | None = None  # [items, labels] bool, multi-label

    @classmethod
    def of(cls, spec: TaskSpec, records: Sequence[Mapping[str, Any]]) -> "Gold":
        gold = spec.gold
        if gold is None:
            raise ValueError("tune needs the spec's gold field")
        if spec.multi_label:
            tags = np.array([[name in gold_tags(r, gold, spec.label_names, spec.gold_sep)
                              for name in spec.label_names] for r in records], dtype=np.bool_).reshape(len(records), -1)
            return cls(spec.label_names, np.full(len(records), -1), tags)
        if spec.choices:
            index = []
            for r in records:
                options = choice_list(r, spec.choices)
                option = option_of(gold_value(r, gold), options)
                if option is None:  # the spec's check of each item refuses this before any model loads
                    raise ValueError(f"gold {gold_value(r, gold)!r} is not one of the item's options")
                index.append(options.index(option))
            return cls((), np.array(index, dtype=int))
        return cls(spec.label_names, np.array([spec.label_names.index(gold_value(r, gold)) for r in records], dtype=int))

    def truth(self) -> np.ndarray:
        """[items, labels] bool: the label is (one of) the item's gold."""
        if self.tags is not None:
            return self.tags
        return self.index[:, None] == np.arange(len(self.labels))[None, :]

    def strata(self) -> list[str]:
        """What cross-validation folds are balanced on: the gold label (or label set)."""
        if self.tags is not None:
            return ["".join("1" if t else "0" for t in row) for row in self.tags]
        return [str(i) for i in self.index]


@dataclass(frozen=True)
class Decided:
    """What one rule decides on every item, before a threshold: the best candidate and its
    probability; multi-label: each label's probability of applying."""

    best: np.ndarray  # [items] int
    top: np.ndarray  # [items] float
    probs: np.ndarray | None = None  # [items, labels], multi-label


@dataclass(frozen=True)
class Outcome:
    """A configuration's decisions, judged: per item right and answered; per item and label,
    said (predicted) and hit (said and true). Figures are weighted sums of these."""

    correct: np.ndarray  # [items] bool
    answered: np.ndarray  # [items] bool
    said: np.ndarray  # [items, labels] bool
    hits: np.ndarray  # [items, labels] bool
    truth: np.ndarray  # [items, labels] bool

    def take(self, index: np.ndarray) -> "Outcome":
        return Outcome(*(a[index] for a in dataclasses.astuple(self)))

    @staticmethod
    def pooled(parts: Sequence[tuple[np.ndarray, "Outcome"]], size: int) -> "Outcome":
        """One outcome from several, each giving the items at its index."""
        first = parts[0][1]
        arrays = [np.zeros((size,) + a.shape[1:], dtype=a.dtype) for a in dataclasses.astuple(first)]
        for index, part in parts:
            for array, values in zip(arrays, dataclasses.astuple(part)):
                array[index] = values[index]
        return Outcome(*arrays)


def judged(decided: Decided, gold: Gold, threshold: float | Sequence[float] | None) -> Outcome:
    """A rule's decisions with a threshold, judged against the gold values: as `run` decides
    (single label: abstain when the best probability is below it; multi-label: a label is on when
    its probability reaches it)."""
    truth = gold.truth()
    if decided.probs is not None:
        limits = np.full(len(gold.labels), 0.5) if threshold is None else np.broadcast_to(
            np.asarray(threshold, dtype=float), (len(gold.labels),))
        said = decided.probs >= limits[None, :]
        correct = (said == truth).all(axis=1)
        return Outcome(correct, np.ones(len(correct), dtype=bool), said, said & truth, truth)
    answered = np.ones(len(decided.best), dtype=bool) if threshold is None else decided.top >= threshold
    correct = answered & (decided.best == gold.index)
    said = answered[:, None] & (decided.best[:, None] == np.arange(len(gold.labels))[None, :])
    return Outcome(correct, answered, said, said & truth, truth)


def figures(outcome: Outcome, weights: np.ndarray) -> dict[str, np.ndarray]:
    """accuracy (an abstention is wrong), coverage, answered accuracy and macro-F1 (the mean over
    labels of 2·hits / (said + true); None without labels), with `weights` per item: [items] for
    the figures, [resamples, items] for bootstrap resamples (then one value per resample)."""
    w = weights.astype(float)
    total = w.sum(axis=-1)
    right, answered = w @ outcome.correct, w @ outcome.answered
    out: dict[str, Any] = {
        "accuracy": right / total,
        "coverage": answered / total,
        "answered_accuracy": np.divide(right, answered, out=np.zeros_like(right), where=answered > 0),
        "macro_f1": None,
    }
    if outcome.truth.shape[1]:
        hits, said, truth = w @ outcome.hits, w @ outcome.said, w @ outcome.truth
        denominator = said + truth
        f1 = np.divide(2 * hits, denominator, out=np.zeros_like(hits), where=denominator > 0)
        out["macro_f1"] = f1.mean(axis=-1) if w.ndim == 1 else _resampled_macro(f1, denominator > 0, outcome)
    return out


def _resampled_macro(f1: np.ndarray, present: np.ndarray, outcome: Outcome) -> np.ndarray:
    """Macro-F1 of bootstrap resamples: the mean over the labels a resample has (as gold or as
    prediction), scaled to the share of labels the items themselves have. Counting a label a
    resample happens to miss as 0, as the figure counts a label the items never have, would pull
    every resample below the figure (with two items a label, one label in eight goes missing)."""
    share = ((outcome.said | outcome.truth).any(axis=0)).mean()
    return f1.sum(axis=-1) / np.maximum(present.sum(axis=-1), 1) * share