"""Metrics the question kinds share: per-class precision, recall and F1, and the expected
calibration error. Plain lists in, plain numbers out; no torch here."""

from __future__ import annotations

from typing import Sequence

BINS = 10


def calibration_error(confidences: Sequence[float], right: Sequence[bool], bins: int = BINS) -> float:
    """Expected calibration error: over equal-width confidence bins, the item-weighted gap between
    the mean confidence and the accuracy."""
    n = len(confidences)
    if not n:
        return 0.0
    totals = [[0, 0.0, 0] for _ in range(bins)]
    for c, r in zip(confidences, right):
        b = min(int(c * bins), bins - 1)
        totals[b][0] += 1
        totals[b][1] += c
        totals[b][2] += bool(r)
    return sum(abs(s / k - h / k) * k for k, s, h in totals if k) / n


def per_class(classes: Sequence[str], said: Sequence[str | None], golds: Sequence[str]) -> dict:
    """Accuracy (an abstention counts as wrong), coverage, and per class precision, recall, F1 and
    support; macro F1 over the classes that occur in the gold or in the answers."""
    n = len(golds)
    per: dict[str, dict[str, float]] = {}
    for c in classes:
        tp = sum(s == c and g == c for s, g in zip(said, golds))
        fp = sum(s == c and g != c for s, g in zip(said, golds))
        fn = sum(s != c and g == c for s, g in zip(said, golds))
        p = tp / (tp + fp) if tp + fp else 0.0
        r = tp / (tp + fn) if tp + fn else 0.0
        per[c] = {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0, "support": tp + fn}
    seen = [c for c in classes if per[c]["support"] or any(s == c for s in said)]
    return {"accuracy": sum(s == g for s, g in zip(said, golds)) / n if n else 0.0,
            "coverage": sum(s is not None for s in said) / n if n else 0.0,
            "macro_f1": sum(per[c]["f1"] for c in seen) / len(seen) if seen else 0.0,
            "per_class": {c: v for c, v in per.items() if c in seen}}
