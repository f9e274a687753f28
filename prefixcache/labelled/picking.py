"""Which unlabelled items to label next (`prefixcache suggest`), from their hidden states and, when
a head is fitted, its margins. Arrays in, indices out: no torch; scikit-learn's k-means.

With a head, the items it is least sure of are the ones whose labels teach it most, but the least
sure items often sit together (near-copies, one confusing corner of the space): labelling twenty
of one kind teaches what one of them would. So the UNCERTAIN x n items of smallest margin are
the candidates, they are grouped into n clusters by their states (k-means, k-means++ seeding), and
each cluster gives its least sure item: n items the head is unsure of, spread over the space.
Without a head (nothing labelled yet), the pool itself is grouped into n clusters and each gives
the item nearest its centre: a seed set that covers the kinds of item the pool holds, rather than
its commonest kind n times or its outliers.

Example:
    picked = pick(states, margins, 50, seed=0)   # indices into the pool, least sure first
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import numpy as np

from ..task.decision import decide

UNCERTAIN = 4  # candidates a pick among the least sure (x n); 1 would be margin sampling alone


def standardised(states: np.ndarray) -> np.ndarray:
    """Each feature centred and scaled over the pool, then each row to unit length: k-means on
    directions, so that no one wide feature of the state (LM states have a few) decides alone."""
    x = np.asarray(states, dtype=np.float64)
    scale = x.std(axis=0)
    z = (x - x.mean(axis=0)) / np.where(scale > 1e-6, scale, 1.0)
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    return z / np.where(norms > 1e-12, norms, 1.0)


def clusters(z: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Each row's cluster among `n` (k-means, k-means++ seeding, a few restarts)."""
    from sklearn.cluster import KMeans

    if n >= len(z):
        return np.arange(len(z))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fewer distinct points than clusters: k-means says so, the picks stand
        return KMeans(n_clusters=n, n_init=3, random_state=seed).fit(z).labels_


def pick(states: np.ndarray, margins: Optional[np.ndarray], n: int, seed: int = 0,
         uncertain: int = UNCERTAIN) -> list[int]:
    """`n` distinct indices into the pool (`states` [N, H]; `margins` [N], the head's, None
    without one): with margins, the least sure of each cluster of the least sure items, least
    sure first; without, the item nearest each cluster's centre of the whole pool, in pool order."""
    total = len(states)
    if n >= total:
        order = np.argsort(margins, kind="stable") if margins is not None else np.arange(total)
        return [int(i) for i in order]
    if margins is None:
        return _representatives(standardised(states), n, seed)
    candidates = np.argsort(np.asarray(margins), kind="stable")[:min(total, max(n, uncertain * n))]
    groups = clusters(standardised(states[candidates]), n, seed)
    chosen = [int(candidates[np.flatnonzero(groups == g)[0]]) for g in np.unique(groups)]  # sorted by margin
    chosen = _filled(chosen, np.argsort(np.asarray(margins), kind="stable"), n)
    return sorted(chosen, key=lambda i: (margins[i], i))


def _filled(chosen: list[int], order: Sequence[int] | np.ndarray, n: int) -> list[int]:
    """`chosen` topped up to `n` from `order` (k-means gives fewer clusters than asked when the
    pool has fewer distinct states: copies of one text)."""
    have = set(chosen)
    for i in order:
        if len(chosen) >= n:
            break
        if int(i) not in have:
            chosen.append(int(i))
            have.add(int(i))
    return chosen


def _representatives(z: np.ndarray, n: int, seed: int) -> list[int]:
    """Per cluster of the pool, the item nearest its centre (the mean of its members)."""
    groups = clusters(z, n, seed)
    out = []
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        centre = z[members].mean(axis=0)
        out.append(int(members[np.argmin(((z[members] - centre) ** 2).sum(axis=1))]))
    return sorted(_filled(out, range(len(z)), n))


def margin_of(probs: Sequence[float], binary: bool, thresholds: Sequence[float] | float | None = None) -> float:
    """How sure a head is of one question's answer: one of several, the top probability minus the
    second; tags, the smallest distance of a tag's P(on) from its threshold (0.5 unless given)."""
    if not binary:
        return float(decide(list(probs))[1])  # the margin every decision records
    p = np.asarray(probs, dtype=np.float64)
    t = np.broadcast_to(np.asarray(0.5 if thresholds is None else thresholds, dtype=np.float64), p.shape)
    return float(np.abs(p - t).min())
