"""From summed log-probabilities to a decision: normalisation, calibration, abstention. No torch.

All functions take and return plain lists, one float per candidate, in candidate order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

NORMALIZATIONS = ("sum", "mean", "chars", "bytes", "pmi")
DEFAULT_CONTENT_FREE = ("N/A", "", "[MASK]")  # calibration's content-free inputs (`calibrate: true`)


@dataclass(frozen=True)
class Groups:
    """Which candidates make the score of each label: a label's forms (their probabilities are
    summed), or a multi-label question's yes and no branches.

    Attributes: names (the labels, in order), members (per label, candidate indices), kind
    ("forms" or "yes/no")."""

    names: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]
    kind: str

    @property
    def plain(self) -> bool:
        """One candidate per label, in label order: candidate scores are the labels' scores."""
        return self.kind == "forms" and all(m == (i,) for i, m in enumerate(self.members))

    def combine(self, logprobs: Sequence[float]) -> list[float]:
        """Each label's log-probability from its candidates': the log of the summed probability
        of its forms, or for yes/no the log-probability of yes against no."""
        if self.plain:
            return list(logprobs)
        if self.kind == "forms":
            return [logsumexp([logprobs[i] for i in m]) for m in self.members]
        return [-softplus(logprobs[no] - logprobs[yes]) for yes, no in self.members]

    def combine_lengths(self, lengths: Sequence[float]) -> list[float]:
        """Per label, the mean of its forms' lengths (tokens, characters or bytes): what mean,
        chars and bytes divide a label's log-probability by."""
        return [sum(lengths[i] for i in m) / len(m) for m in self.members]


def logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def softplus(x: float) -> float:
    """log(1 + e^x), without overflow."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def normalise(
    logprobs: Sequence[float],
    how: str,
    token_counts: Sequence[float] = (),
    texts: Sequence[str] = (),
    unconditional: Sequence[float] = (),
    sizes: Sequence[float] = (),
) -> list[float]:
    """Scores compared across candidates (`sizes`, when given, replaces the texts' lengths).

    sum: total log-prob. mean: per token. chars / bytes: per character / UTF-8 byte of the
    candidate text (lm-evaluation-harness's acc_norm / acc_bytes). pmi: total log-prob minus the
    candidate's log-prob after a content-free prompt (mutual information).
    """
    if how == "sum":
        return list(logprobs)
    if how == "mean":
        return [lp / n for lp, n in zip(logprobs, token_counts)]
    if how in ("chars", "bytes") and sizes:
        return [lp / max(n, 1) for lp, n in zip(logprobs, sizes)]
    if how == "chars":
        return [lp / max(len(t), 1) for lp, t in zip(logprobs, texts)]
    if how == "bytes":
        return [lp / max(len(t.encode("utf-8")), 1) for lp, t in zip(logprobs, texts)]
    if how == "pmi":
        return [lp - u for lp, u in zip(logprobs, unconditional)]
    raise ValueError(f"unknown normalisation {how!r}")


def linear_keys(how: str, token_counts: Sequence[int] = (), texts: Sequence[str] = (),
                unconditional: Sequence[float] = (), prior: Sequence[float] | None = None,
                ) -> tuple[list[float], list[float]]:
    """Per candidate, (scale, offset) with scale > 0 such that `scale * logprob + offset` ranks the
    candidates as the decision does (after normalisation and calibration), and its softmax is the
    decision's distribution. As a candidate's summed log-prob can only fall as tokens are added,
    the same expression on a partial sum bounds its final value from above: what pruned label
    scoring relies on (every normalisation here, `mean` included: a label's token count is fixed)."""
    n = len(token_counts) or len(texts) or len(unconditional)
    scales, offsets = [1.0] * n, [0.0] * n
    if how == "mean":
        scales = [1 / c for c in token_counts]
    elif how == "chars":
        scales = [1 / max(len(t), 1) for t in texts]
    elif how == "bytes":
        scales = [1 / max(len(t.encode("utf-8")), 1) for t in texts]
    elif how == "pmi":
        offsets = [-u for u in unconditional]
    if prior:
        offsets = [o - math.log(max(q, 1e-12)) for o, q in zip(offsets, prior)]
    return scales, offsets


class Bounded(list):
    """Label log-probabilities of which those at `pruned` positions are upper bounds (pruned
    label scoring stopped scoring them once they could not win)."""

    def __init__(self, values: Sequence[float] = (), pruned: Sequence[int] = ()):
        super().__init__(values)
        self.pruned = tuple(pruned)


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


def ranked(probs: Sequence[float]) -> tuple[int, float]:
    """Index of the most probable candidate (ties: the first) and the margin between the two
    most probable (1.0 with one candidate)."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    best = order[0]
    return best, probs[best] - probs[order[1]] if len(order) > 1 else 1.0


def decide(probs: Sequence[float], threshold: float | None = None) -> tuple[int | None, float]:
    """Index of the most probable candidate (ties: the first), or None below `threshold`; and
    the margin between the two most probable (1.0 with one candidate)."""
    best, margin = ranked(probs)
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
    token_counts: Sequence[float],
    texts: Sequence[str],
    unconditional: Sequence[float] = (),
    prior: Sequence[float] | None = None,
    threshold: float | None = None,
    sizes: Sequence[float] = (),
) -> Decision:
    """Normalise, turn into a distribution, calibrate by `prior` when given, and decide."""
    raw = softmax(normalise(logprobs, how, token_counts, texts, unconditional, sizes))
    probs = calibrate(raw, prior) if prior else raw
    best, margin = decide(probs, threshold)
    return Decision(probs, raw if prior else None, best, margin)


@dataclass(frozen=True)
class Tags:
    """What a multi-label item's scores decide, in label order."""

    probs: list[float]  # P(yes) against no per label (calibrated when `raw` is set)
    raw: list[float] | None  # before calibration; None when the task is not calibrated
    on: list[bool]  # the label applies: its probability reaches its threshold


def yes_probs(logprobs: Sequence[float]) -> list[float]:
    """Per label, P(yes) / (P(yes) + P(no)) from the log of it (`Groups.combine`)."""
    return [math.exp(lp) for lp in logprobs]


def judge_tags(logprobs: Sequence[float], thresholds: Sequence[float], prior: Sequence[float] | None = None) -> Tags:
    """Each label on its own: P(yes) against no, calibrated by the label's content-free P(yes)
    when `prior` is given, and on when it reaches the label's threshold."""
    raw = yes_probs(logprobs)
    probs = [calibrate([p, 1 - p], [q, 1 - q])[0] for p, q in zip(raw, prior)] if prior else raw
    return Tags(probs, raw if prior else None, [p >= t for p, t in zip(probs, thresholds)])


def log_odds(p: float) -> float:
    """log(p / (1 - p)), finite at 0 and 1."""
    p = min(max(p, 1e-300), 1 - 1e-16)
    return math.log(p) - math.log1p(-p)
