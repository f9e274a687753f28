"""From summed log-probabilities to a decision: normalisation, calibration, abstention. No torch.

All functions take and return plain lists, one float per candidate, in candidate order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

NORMALIZATIONS = ("sum", "mean", "chars", "bytes", "pmi")


def normalise(
    logprobs: Sequence[float],
    how: str,
    token_counts: Sequence[int] = (),
    texts: Sequence[str] = (),
    unconditional: Sequence[float] = (),
) -> list[float]:
    """Scores compared across candidates.

    sum: total log-prob. mean: per token. chars / bytes: per character / UTF-8 byte of the
    candidate text (lm-evaluation-harness's acc_norm / acc_bytes). pmi: total log-prob minus the
    candidate's log-prob after a content-free prompt (mutual information).
    """
    if how == "sum":
        return list(logprobs)
    if how == "mean":
        return [lp / n for lp, n in zip(logprobs, token_counts)]
    if how == "chars":
        return [lp / max(len(t), 1) for lp, t in zip(logprobs, texts)]
    if how == "bytes":
        return [lp / max(len(t.encode("utf-8")), 1) for lp, t in zip(logprobs, texts)]
    if how == "pmi":
        return [lp - u for lp, u in zip(logprobs, unconditional)]
    raise ValueError(f"unknown normalisation {how!r}")


def softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def calibrate(probs: Sequence[float], prior: Sequence[float]) -> list[float]:
    """Contextual calibration (Zhao et al. 2021): divide out the label prior the prompt alone
    induces, then renormalise. `prior` is the mean distribution over content-free inputs."""
    weighted = [p / max(q, 1e-12) for p, q in zip(probs, prior)]
    total = sum(weighted)
    return [w / total for w in weighted]


def mean_distribution(distributions: Sequence[Sequence[float]]) -> list[float]:
    n = len(distributions)
    return [sum(col) / n for col in zip(*distributions)]


def decide(probs: Sequence[float], threshold: float | None = None) -> tuple[int | None, float]:
    """Index of the most probable candidate (ties: the first), or None below `threshold`; and
    the margin between the two most probable (1.0 with one candidate)."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    best = order[0]
    margin = probs[best] - probs[order[1]] if len(order) > 1 else 1.0
    if threshold is not None and probs[best] < threshold:
        return None, margin
    return best, margin


@dataclass(frozen=True)
class Decision:
    """What the scores of one item's candidates decide, in candidate order."""

    probs: list[float]  # the distribution the decision is made on (calibrated when `raw` is set)
    raw: list[float] | None  # before calibration; None when the task is not calibrated
    best: int | None  # None: abstained (top probability below the threshold)
    margin: float  # top probability minus the second


def judge(
    logprobs: Sequence[float],
    how: str,
    token_counts: Sequence[int],
    texts: Sequence[str],
    unconditional: Sequence[float] = (),
    prior: Sequence[float] | None = None,
    threshold: float | None = None,
) -> Decision:
    """Normalise, turn into a distribution, calibrate by `prior` when given, and decide."""
    raw = softmax(normalise(logprobs, how, token_counts, texts, unconditional))
    probs = calibrate(raw, prior) if prior else raw
    best, margin = decide(probs, threshold)
    return Decision(probs, raw if prior else None, best, margin)
