"""Where a fitted head should abstain: the confidence cut-point whose answered items reach a target
accuracy with a stated confidence, chosen on the head's held-out (cross-validated) predictions,
and the risk-coverage table around it. No torch, no scikit-learn.

The accuracy of the items answered at a cut is a binomial proportion; its lower bound is the
one-sided Clopper-Pearson (exact) bound at `confidence`. Cuts are tried in a fixed sequence, most confident first
(the items a cut answers are the top COVERAGE_STEP, 2 x COVERAGE_STEP, ... of the items by the
head's probability; cuts answering too few items for even a perfect record to reach the target
are passed over, which depends on the counts alone), and the sequence stops at the first cut
whose bound misses the target: the chosen cut is the last that passed. Testing in a fixed order and stopping at the first miss holds
the whole choice to the stated confidence, where keeping the best of many cuts each tested alone
would not.

Example:
    cut = choose_cut(held_out_max_prob, held_out_correct, target=0.95)
    cut.chosen.cut  # abstain below this probability; None when no cut reaches the target
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

COVERAGE_STEP = 0.05  # the fixed sequence's steps of coverage
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Row:
    """One cut: the items whose probability is at least `cut` are answered, the rest abstained."""

    cut: float
    answered: int
    total: int
    correct: int
    low: float  # the accuracy's one-sided lower bound at the cut's confidence
    high: float  # and its upper bound, at the same level

    @property
    def coverage(self) -> float:
        return self.answered / self.total if self.total else 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.answered if self.answered else 0.0

    def to_json(self) -> dict:
        return {"cut": round(self.cut, 6), "coverage": round(self.coverage, 4), "answered": self.answered,
                "accuracy": round(self.accuracy, 4), "low": round(self.low, 4), "high": round(self.high, 4)}


@dataclass(frozen=True)
class Cut:
    """What was asked (a target accuracy, or a coverage), at which confidence, the row chosen
    (None: no cut reaches the target) and the risk-coverage table (every step, most confident first)."""

    target: float | None
    coverage: float | None
    confidence: float
    chosen: Row | None
    table: list[Row] = field(default_factory=list)
    missed: Row | None = None  # the cut the sequence stopped at (its lower bound missed the target)
    per_option: dict[int, Row] = field(default_factory=dict)  # options with a cut of their own (`per_option_cuts`)
    together: Row | None = None  # the items answered under the per-option cuts and `chosen` for the rest (its
    # cut: the lowest of them)

    def to_json(self) -> dict:
        return {"target_accuracy": self.target, "coverage": self.coverage, "confidence": self.confidence,
                "chosen": self.chosen.to_json() if self.chosen else None, "table": [r.to_json() for r in self.table],
                **({"per_option": {str(k): r.to_json() for k, r in self.per_option.items()},
                    "together": self.together.to_json()} if self.per_option and self.together else {})}


def bounds(correct: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The one-sided Clopper-Pearson (exact binomial) bounds (lower, upper) of a proportion
    `correct`/`n` at `confidence`. Exact rather than Wilson's: measured on calibrated synthetic
    heads, Wilson's bound let the chosen cut miss its target on fresh data in up to 13% of seeds at
    200 items and a 0.95 target; the exact bound, in at most 4% (test_cutpoint.py)."""
    from scipy.stats import beta  # scikit-learn's own dependency (the fit extra)

    if n == 0:
        return 0.0, 1.0
    alpha = 1 - confidence
    low = 0.0 if correct == 0 else float(beta.ppf(alpha, correct, n - correct + 1))
    high = 1.0 if correct == n else float(beta.ppf(1 - alpha, correct + 1, n - correct))
    return low, high


def risk_coverage(confidence_of: Sequence[float], correct: Sequence[bool], confidence: float = CONFIDENCE,
                  step: float = COVERAGE_STEP) -> list[Row]:
    """The fixed sequence of cuts: answering the top `step`, 2 x `step`, ... of the items by
    probability (ties answered together), most confident first, the last answering every item."""
    conf = np.asarray(confidence_of, dtype=float)
    right = np.asarray(correct, dtype=bool)
    order = np.argsort(-conf, kind="stable")
    n, rows, seen = len(conf), [], set()
    for k in range(1, int(round(1 / step)) + 1):
        at = max(1, min(n, int(math.ceil(k * step * n - 1e-9))))
        cut = float(conf[order[at - 1]])
        if cut in seen:
            continue
        seen.add(cut)
        answered = conf >= cut
        rows.append(_row(cut, int(answered.sum()), n, int(right[answered].sum()), confidence))
    return rows


def _row(cut: float, answered: int, total: int, correct: int, confidence: float) -> Row:
    low, high = bounds(correct, answered, confidence)
    return Row(cut, answered, total, correct, low, high)


def choose_cut(confidence_of: Sequence[float], correct: Sequence[bool], target: float | None = None,
               coverage: float | None = None, confidence: float = CONFIDENCE) -> Cut:
    """The cut for `target` accuracy (fixed-sequence: the widest cut before the first whose lower
    bound misses it) or for `coverage` (the cut answering at least that share of the items)."""
    if (target is None) == (coverage is None):
        raise ValueError("give a target accuracy or a coverage, not both")
    table = risk_coverage(confidence_of, correct, confidence)
    if coverage is not None:
        chosen = next((r for r in table if r.coverage >= coverage - 1e-9), table[-1] if table else None)
        return Cut(None, coverage, confidence, chosen, table)
    assert target is not None  # one of the two is given
    chosen, missed, fewest = None, None, least_items(target, confidence)
    for row in table:
        if row.answered < fewest:
            continue  # too few items for any record to pass: not a test (it does not depend on the data)
        if row.low < target:
            missed = row
            break
        chosen = row
    return Cut(target, None, confidence, chosen, table, missed)


def least_items(target: float, confidence: float = CONFIDENCE) -> int:
    """The fewest answered items whose accuracy can reach `target` at `confidence` (all right)."""
    n = 1
    while bounds(n, n, confidence)[0] < target and n < 10**7:
        n = max(n + 1, int(n * 1.1))
    while n > 1 and bounds(n - 1, n - 1, confidence)[0] >= target:
        n -= 1
    return n


def per_option_cuts(cut: Cut, confidence_of: Sequence[float], answer: Sequence[int], correct: Sequence[bool]) -> Cut:
    """`cut` (for a target) with a cut of its own for each answer the data supports: answered often
    enough (held out) for a perfect record to reach the target, and whose own fixed sequence
    certifies a cut. The other answers keep `cut.chosen` (none chosen: they always abstain, at
    ABSTAIN_ALL). Kept only when the cuts together answer more items than `cut.chosen` alone and
    the items they answer, all answers together, still reach the target at the confidence (one more
    test, on the same held-out predictions); else `cut` as it was."""
    if cut.target is None:
        return cut
    conf, ans, right = (np.asarray(a) for a in (confidence_of, answer, correct))
    rest = cut.chosen.cut if cut.chosen is not None else ABSTAIN_ALL
    fewest, own = least_items(cut.target, cut.confidence), {}
    for k in np.unique(ans):
        mine = ans == k
        if mine.sum() >= fewest:
            found = choose_cut(conf[mine], right[mine], cut.target, confidence=cut.confidence).chosen
            if found is not None and found.cut != rest:
                own[int(k)] = found
    if not own:
        return cut
    bar = np.array([own[int(k)].cut if int(k) in own else rest for k in ans])
    answered = conf >= bar
    together = _row(float(bar.min()), int(answered.sum()), len(conf), int(right[answered].sum()), cut.confidence)
    if together.answered <= (cut.chosen.answered if cut.chosen else 0) or together.low < cut.target:
        return cut
    return replace(cut, per_option=own, together=together)


ABSTAIN_ALL = 1.0  # the threshold of answers without a cut of their own when no one cut reaches the target


def items_to_certify(target: float, accuracy: float, confidence: float = CONFIDENCE, most: int = 10**6) -> int | None:
    """The fewest answered items at `accuracy` whose lower bound reaches `target` (None: not
    below `most`, or `accuracy` is not above the target)."""
    if accuracy <= target:
        return None
    n = least_items(target, confidence)
    while n <= most:
        if bounds(int(math.floor(accuracy * n)), n, confidence)[0] >= target:
            return n
        n = max(n + 1, int(n * 1.05))
    return None
