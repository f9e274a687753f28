"""Choosing a configuration honestly, and how sure the choice is. No torch.

Each configuration (a prompt variant, a rule, a threshold fitted or the spec's) is judged on items
it was not chosen or fitted on: in k-fold cross-validation every fold is predicted by what the
other folds chose (with `--test`, the test items by what the labelled ones chose). A row's figures
pool those held-out predictions; the tuned figure is the selection procedure's own held-out score,
and it is compared with the spec as written on the same items by a paired bootstrap. A winner is
declared only when that gain's interval (98%: a 1% chance of a false winner when nothing differs)
lies above zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..reports.resampling import GAIN_LEVEL, Figure, interval, resamples
from .rules import GRID, Decided, Gold, Outcome, Rule, figures, judged


@dataclass(frozen=True)
class Config:
    """A candidate: prompt variant (its index), rule, and whether its threshold is fitted on
    labelled items (else the spec's)."""

    variant: int
    rule: Rule
    fitted: bool = False


@dataclass(frozen=True)
class Goal:
    """What the choice maximises: `metric` ("accuracy" or "macro_f1"); with `min_coverage`, the
    accuracy of the answered items among thresholds that answer at least that share."""

    metric: str = "accuracy"
    min_coverage: float | None = None
    spec_threshold: Any = None  # the spec's: a number or None; multi-label: one per label

    @property
    def figure(self) -> str:
        """The figure compared: accuracy, macro_f1 or answered_accuracy."""
        return "answered_accuracy" if self.min_coverage is not None else self.metric

    def score(self, outcome: Outcome) -> float | None:
        """The goal's value on these items; None when a coverage floor is missed."""
        found = figures(outcome, np.ones(len(outcome.correct)))
        if self.min_coverage is not None and found["coverage"] < self.min_coverage - 1e-12:
            return None
        value = found[self.figure]
        return None if value is None else float(value)


class Search:
    """The candidates' outcomes and the choice among them."""

    def __init__(self, decided: Mapping[tuple[int, Rule], Decided], gold: Gold, goal: Goal,
                 configs: Sequence[Config], default: Config):
        self.decided, self.gold, self.goal = decided, gold, goal
        self.configs, self.default = list(configs), default
        self._fixed: dict[Config, Outcome] = {}

    def outcome(self, config: Config, fit: np.ndarray) -> tuple[Outcome, Any]:
        """The config's outcome on every item, and its threshold (fitted on the items `fit`)."""
        decided = self.decided[(config.variant, config.rule)]
        if not config.fitted:
            if config not in self._fixed:
                self._fixed[config] = judged(decided, self.gold, self.goal.spec_threshold)
            return self._fixed[config], self.goal.spec_threshold
        best: tuple[float, float, Any] | None = None
        for rank, threshold in enumerate(self._grid()):
            outcome = judged(decided, self.gold, threshold)
            value = self.goal.score(outcome.take(fit))
            if value is not None and (best is None or value > best[0]):
                best = (value, rank, threshold)
        threshold = best[2] if best else self.goal.spec_threshold
        return judged(decided, self.gold, threshold), threshold

    def _grid(self) -> list[Any]:
        """Thresholds a fitted one is chosen from, the preferred first on ties: for a single label
        no threshold (answer every item), then from low to high; multi-label, nearest 0.5 first."""
        if self.gold.tags is not None:
            return sorted(GRID, key=lambda t: (abs(t - 0.5), t))
        return [None, *GRID]

    def choose(self, fit: np.ndarray) -> tuple[Config, dict[Config, tuple[Outcome, Any]]]:
        """The config with the best goal on the items `fit` (ties: the spec as written, then the
        first listed), and every config's outcome and threshold fitted there."""
        results = {config: self.outcome(config, fit) for config in self.configs}
        ranked = sorted(self.configs, key=lambda c: (c != self.default, self.configs.index(c)))
        best, best_value = self.default, -math.inf
        for config in ranked:
            value = self.goal.score(results[config][0].take(fit))
            if value is not None and value > best_value + 1e-12:
                best, best_value = config, value
        return best, results


def measured(figure: Figure | None) -> Figure:
    """A figure every search measures (accuracy, coverage and the goal's own figure)."""
    if figure is None:
        raise ValueError("a figure the search always measures is missing")
    return figure


@dataclass
class Row:
    """One configuration on the leaderboard."""

    config: Config
    figures: dict[str, Figure | None]  # accuracy, macro_f1, coverage, answered_accuracy: held-out
    threshold: Any  # the threshold it runs with: fitted on every labelled item, or the spec's
    as_run: dict[str, float | None]  # with that threshold, on the held-out items: what `run` gives
    picked: int = 0  # splits whose choice it was


@dataclass
class Selection:
    """The outcome of a search: every row, the choice, and the verdict."""

    rows: list[Row]
    pick: Row
    default: Row
    tuned: dict[str, Figure | None]  # the selection procedure's held-out figures
    gain: Figure  # tuned minus the spec as written, in the goal's figure
    splits: int
    held_out: int  # items the figures are measured on
    goal: Goal
    verdict: str = ""  # "winner", "spec" (the spec as written is the choice), "no winner"


def select(search: Search, splits: Sequence[tuple[np.ndarray, np.ndarray]], fit_all: np.ndarray,
           seed: int = 0) -> Selection:
    """Choose on each split's fit items, judge on its held-out items; choose once more on
    `fit_all` (what `-o` writes); put intervals on every figure."""
    pooled: dict[Config, list] = {c: [] for c in search.configs}
    tuned_parts, picks = [], {c: 0 for c in search.configs}
    size = len(search.gold.index)
    for fit, held in splits:
        choice, results = search.choose(fit)
        picks[choice] += 1
        tuned_parts.append((held, results[choice][0]))
        for config in search.configs:
            pooled[config].append((held, results[config][0]))
    held_out = np.sort(np.concatenate([held for _, held in splits]))
    final, finals = search.choose(fit_all)
    outcomes = {c: Outcome.pooled(parts, size).take(held_out) for c, parts in pooled.items()}
    tuned = Outcome.pooled(tuned_parts, size).take(held_out)
    intervals = _intervals({**outcomes, "tuned": tuned}, search.default, search.goal, seed)
    rows = []
    for config in search.configs:
        as_run = figures(finals[config][0].take(held_out), np.ones(len(held_out)))
        rows.append(Row(config, intervals[config], finals[config][1],
                        {k: (None if v is None else float(v)) for k, v in as_run.items()}, picks[config]))
    by_config = {row.config: row for row in rows}
    gain = intervals["gain"]
    selection = Selection(rows, by_config[final], by_config[search.default], intervals["tuned"], gain, len(splits),
                          len(held_out), search.goal)
    selection.verdict = "spec" if final == search.default else "winner" if gain.low > 0 else "no winner"
    selection.rows = sorted(rows, key=lambda r: (-_goal_value(r, search.goal), search.configs.index(r.config)))
    return selection


def _goal_value(row: Row, goal: Goal) -> float:
    figure = row.figures.get(goal.figure)
    if goal.min_coverage is not None and measured(row.figures["coverage"]).value < goal.min_coverage - 1e-12:
        return -math.inf
    return figure.value if figure is not None else -math.inf


def _intervals(outcomes: Mapping[Any, Outcome], default: Config, goal: Goal, seed: int) -> dict[Any, Any]:
    """Every outcome's figures with percentile bootstrap intervals over the same resamples of the
    items; and "gain": the "tuned" outcome's goal figure minus `default`'s, paired."""
    keys = list(outcomes)
    items = len(outcomes[keys[0]].correct)
    points = {k: figures(o, np.ones(items)) for k, o in outcomes.items()}
    draws: dict[Any, dict[str, list]] = {k: {} for k in keys}
    for weights in resamples(items, seed):
        for k, outcome in outcomes.items():
            for name, values in figures(outcome, weights).items():
                if values is not None:
                    draws[k].setdefault(name, []).append(values)
    out: dict[Any, Any] = {}
    for k in keys:
        out[k] = {name: (None if points[k][name] is None else
                         interval(float(points[k][name]), np.concatenate(draws[k][name])))
                  for name in points[k]}
    figure = goal.figure
    diff = np.concatenate(draws["tuned"][figure]) - np.concatenate(draws[default][figure])
    out["gain"] = interval(float(points["tuned"][figure] - points[default][figure]), diff, GAIN_LEVEL)
    return out
