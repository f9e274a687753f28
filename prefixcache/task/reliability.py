"""How often a head's answers were right at each confidence, measured on held-out rows when it was
fitted: what an answer's probability is worth (`p_correct` in a record), so that a run's accuracy
can be estimated without labels from answers whose own probabilities claim too much. No torch here.

`fit` cross-validates the head; each held-out row's answer, its probability and whether it was
right give a step function from the probability to the share right (`Reliability`): a monotone
fit (pool adjacent violators), each step's share pulled toward the overall held-out accuracy by
PRIOR rows, so that a handful of rows does not say 0 or 1.

Example:
    reliability = fitted_reliability(top_probs, right)   # held-out rows
    reliability.at(0.83)                                 # the share right of answers that sure
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

PRIOR = 2.0  # rows' worth of the overall held-out accuracy in each step


@dataclass(frozen=True)
class Reliability:
    """A step function: answers with a probability up to `upto[i]` (and above the step before) were
    right `right[i]` of the time; above the last step, as the last."""

    upto: tuple[float, ...]
    right: tuple[float, ...]

    def at(self, probability: float) -> float:
        for edge, share in zip(self.upto, self.right, strict=True):
            if probability <= edge:
                return share
        return self.right[-1]

    def to_json(self) -> dict[str, list[float]]:
        return {"upto": [round(v, 6) for v in self.upto], "right": [round(v, 6) for v in self.right]}

    @classmethod
    def from_json(cls, value: Any) -> "Reliability | None":
        """One read from a head file's header (None: not one)."""
        if not isinstance(value, dict) or set(value) != {"upto", "right"}:
            return None
        upto, right = value["upto"], value["right"]
        numbers = [v for v in (*upto, *right) if isinstance(v, (int, float)) and not isinstance(v, bool)] \
            if isinstance(upto, list) and isinstance(right, list) else []
        if (not upto or len(upto) != len(right) or len(numbers) != 2 * len(upto)
                or not all(0 <= v <= 1 for v in numbers) or list(upto) != sorted(upto)):
            return None
        return cls(tuple(float(v) for v in upto), tuple(float(v) for v in right))


def fitted_reliability(confidence: Sequence[float], right: Sequence[bool]) -> Reliability | None:
    """The step function of held-out answers' probabilities (`confidence`) and whether each was
    right: monotone, each step's share smoothed toward the overall one (None: no rows)."""
    p = np.asarray(confidence, dtype=np.float64)
    y = np.asarray(right, dtype=np.float64)
    if not len(p):
        return None
    order = np.argsort(p, kind="stable")
    p, y = p[order], y[order]
    blocks: list[list[float]] = []  # [summed right, rows, highest probability]
    for pi, yi in zip(p, y, strict=True):
        blocks.append([yi, 1.0, pi])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            top = blocks.pop()
            blocks[-1] = [blocks[-1][0] + top[0], blocks[-1][1] + top[1], top[2]]
    overall = float(y.mean())
    shares = [(k + PRIOR * overall) / (n + PRIOR) for k, n, _ in blocks]
    return Reliability(tuple(float(edge) for _, _, edge in blocks), tuple(shares))
