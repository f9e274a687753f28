"""What the states a head was fitted on look like, kept compact and without any text: how far a new
item's state lies from them (its `novelty`), so that a run can say which items are unlike anything
the head learnt from. No torch here.

A summary (`Familiar`) standardises a state (the views a readout reads, at its first answer
position), projects it on the fitted rows' leading principal directions and measures two things,
each 1 on average over the fitted rows: its squared distance along those directions in units of
their spread, and its squared distance off them. The score is the root of their mean. The cut is
what 99% of fitted rows score when held out (cross-fitted: each fold scored by a summary of the
others), so that `novelty` = score / cut is above 1 for about 1% of items like the fitted ones, and
for far more of items from elsewhere.

Example:
    familiar = summarise(states)                    # [N, D], the fitted rows' states
    novelty = familiar.novelty(state)              # one item's [D]: above 1, unlike the fitted rows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

COMPONENTS = 16  # principal directions kept (fewer with fewer rows)
QUANTILE = 0.99  # of held-out fitted rows' scores: the cut
FOLDS = 5


def beyond(novelty: Any) -> bool:
    """Whether a record's item lies beyond 99% of a head's fitted rows: its `novelty` above 1 (a
    pack's, per question: on any question)."""
    values = novelty.values() if isinstance(novelty, dict) else [novelty]
    return any(isinstance(v, (int, float)) and v > 1 for v in values)


@dataclass(frozen=True)
class Familiar:
    """The fitted rows' states in brief: `center`, `scale` ([D]: their standardisation), `basis`
    ([k, D]: leading directions), `spread` ([k]: the rows' standard deviation along each),
    `residual` (their mean squared distance off the directions, per dimension) and `cut`."""

    center: np.ndarray
    scale: np.ndarray
    basis: np.ndarray
    spread: np.ndarray
    residual: float
    cut: float = 1.0

    def score(self, state: np.ndarray) -> float:
        """How far one state ([D]) lies from the fitted rows (about 1 for one like them)."""
        z = (np.asarray(state, dtype=np.float64) - self.center) / self.scale
        along = self.basis @ z
        within = float(np.mean((along / self.spread) ** 2)) if len(along) else 0.0
        off = max(float(z @ z - along @ along), 0.0) / max(len(z) - len(along), 1) / self.residual
        return float(np.sqrt((within + off) / 2 if len(along) else off))

    def novelty(self, state: np.ndarray) -> float:
        """The score in units of the cut: above 1, the item lies beyond 99% of held-out fitted rows."""
        return self.score(state) / self.cut

    def check(self, width: int) -> str | None:
        """What is wrong with a summary read from a file (None: nothing)."""
        k = self.basis.shape[0] if self.basis.ndim == 2 else -1
        if (self.center.shape != (width,) or self.scale.shape != (width,) or self.basis.shape != (k, width)
                or self.spread.shape != (k,)):
            return "its familiarity arrays do not have the state's width"
        if not all(np.isfinite(a).all() for a in (self.center, self.scale, self.basis, self.spread)):
            return "its familiarity arrays hold NaN or infinite values"
        if (self.scale <= 0).any() or (self.spread <= 0).any() or not self.residual > 0 or not self.cut > 0:
            return "its familiarity scales are not positive"
        return None


def fitted(states: np.ndarray, components: int = COMPONENTS) -> Familiar:
    """The summary of `states` ([N, D]) with the cut at 1 (see `summarise`)."""
    x = np.asarray(states, dtype=np.float64)
    center = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(scale > 1e-8 * max(float(scale.max()), 1e-30), scale, 1.0)
    z = (x - center) / scale
    k = max(0, min(components, len(x) - 2, x.shape[1] - 1))
    _, values, vt = np.linalg.svd(z, full_matrices=False)
    basis, spread = vt[:k], values[:k] / np.sqrt(max(len(x) - 1, 1))
    keep = spread > 1e-8
    basis, spread = basis[keep], spread[keep]
    along = z @ basis.T
    off = np.maximum((z * z).sum(axis=1) - (along * along).sum(axis=1), 0.0) / max(x.shape[1] - len(basis), 1)
    return Familiar(center, scale, basis, spread, max(float(off.mean()), 1e-12))


def summarise(states: np.ndarray, seed: int = 0, components: int = COMPONENTS) -> Familiar:
    """The summary of the fitted rows' states ([N, D]) and its cut: the QUANTILE of each row's
    score under a summary of the other folds' rows (held out, so the cut holds for new items)."""
    x = np.asarray(states, dtype=np.float64)
    whole = fitted(x, components)
    folds = min(FOLDS, len(x))
    if folds < 2 or len(x) < 4:
        return whole
    order = np.random.default_rng(seed).permutation(len(x))
    scores = []
    for f in range(folds):
        held = order[f::folds]
        rest = np.setdiff1d(order, held)
        part = fitted(x[rest], components)
        scores += [part.score(row) for row in x[held]]
    cut = float(np.quantile(scores, QUANTILE))
    return Familiar(whole.center, whole.scale, whole.basis, whole.spread, whole.residual, max(cut, 1e-6))
