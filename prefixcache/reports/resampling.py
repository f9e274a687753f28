"""The statistics the tuning and the labelled-data loop share: folds that keep a text's copies
together, bootstrap resamples, and bias-corrected percentile intervals. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Iterator, Sequence

import numpy as np

RESAMPLES = 1000  # bootstrap resamples behind every interval
LEVEL = 0.95  # the figures' intervals
GAIN_LEVEL = 0.98  # the gain's: a winner needs its lower end (the 1st percentile) above zero


def cv_splits(strata: Sequence[str], folds: int, seed: int = 0, groups: Sequence[str] | np.ndarray | None = None
              ) -> list[tuple[np.ndarray, np.ndarray]]:
    """k folds balanced on `strata` (each stratum's items, shuffled, dealt round-robin): per fold
    the indices it is fitted on and those it predicts. With `groups`, the items of one group (the
    copies of one text) are dealt together, by the stratum of the first, so that no fold is
    predicted by a head fitted on a copy of its item (without copies, the same folds)."""
    rng = np.random.default_rng(seed)
    first: dict[str, int] = {}
    for i, g in enumerate(groups if groups is not None else range(len(strata))):
        first.setdefault(str(g), len(first))
    unit = [first[str(g)] for g in (groups if groups is not None else range(len(strata)))]  # [N] group index
    leads = {u: i for i, u in reversed(list(enumerate(unit)))}  # group index -> its first item
    order = rng.permutation(len(first))
    ranked = sorted(order, key=lambda u: strata[leads[u]])  # stable: shuffled within each stratum
    fold_of_unit = np.empty(len(first), dtype=int)
    for position, u in enumerate(ranked):
        fold_of_unit[u] = position % folds
    fold_of = fold_of_unit[np.array(unit, dtype=int)] if unit else np.empty(0, dtype=int)
    everything = np.arange(len(strata))
    return [(everything[fold_of != f], everything[fold_of == f]) for f in range(folds)]


@dataclass
class Figure:
    """A figure on the held-out items, with its bootstrap interval."""

    value: float
    low: float
    high: float

    def to_json(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


def interval(value: float, draws: np.ndarray, level: float = LEVEL) -> Figure:
    """A bias-corrected percentile interval (Efron 1987): the percentiles are moved by how far
    the resamples' median sits from the figure. Macro-F1 needs it: a resample that misses a rare
    label scores it 0, so the resamples fall below the figure and plain percentiles can leave the
    figure outside its own interval."""
    normal = NormalDist()
    below = (np.sum(draws < value) + 0.5 * np.sum(draws == value)) / len(draws)
    below = min(max(float(below), 0.5 / len(draws)), 1 - 0.5 / len(draws))
    z0, z = normal.inv_cdf(below), normal.inv_cdf((1 + level) / 2)
    low, high = normal.cdf(2 * z0 - z), normal.cdf(2 * z0 + z)
    return Figure(value, float(np.percentile(draws, 100 * low)), float(np.percentile(draws, 100 * high)))


def resamples(items: int, seed: int, chunk: int = 100) -> Iterator[np.ndarray]:
    """RESAMPLES bootstrap resamples of the items, as counts per item, a chunk at a time."""
    rng = np.random.default_rng(seed + 1)
    for start in range(0, RESAMPLES, chunk):
        yield rng.multinomial(items, np.full(items, 1 / items), size=min(chunk, RESAMPLES - start))
