"""Pruned label scoring: the argmax of many labels at the cost of a few.

Every label's first token is scored from the same logits row, at the item's last position. A
label's summed log-prob only falls as its tokens are added, so after its first token
`scale * logprob + offset` (decision.linear_keys: the spec's normalisation and calibration as a
ranking key) bounds its final key from above. Per batch:

1. the items' own tokens go through the model once (model/branches.py), giving every label's
   first-token bound;
2. the few labels with the highest bounds are scored to the end;
3. every other label whose bound is below the best complete key can never win: it is pruned;
   the rest still in the race are scored to the end;
4. with a `threshold`, the winner's probability is checked against it with the pruned labels at
   their bounds (a lower bound of the probability); when that cannot settle abstention, the
   pruned labels are scored to the end too.

The decision (argmax, abstention) and the winner's log-prob are exactly those of full scoring; a
pruned label's value is its first-token log-prob, an upper bound, and `Bounded.pruned` says which.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..model.branches import open_items
from ..model.engine import Engine, Prefix
from ..task.decision import Bounded
from .prepare import Prepared

FIRST = 4  # labels scored to the end before pruning: the highest first-token bounds
SLACK = 1e-9  # a bound must fall this far below the best key to prune (no float ties decide)


def score_pruned(engine: Engine, prefix: Prefix, preps: Sequence[Prepared], scales: Sequence[float],
                 offsets: Sequence[float], threshold: float | None) -> tuple[list[Bounded], int]:
    """Each item's label log-probs (pruned ones as bounds), and the label tokens run through the
    model for them (trie nodes after the items)."""
    opened = open_items(engine, prefix, [p.row for p in preps])
    cands = [list(p.candidates.values()) for p in preps]
    lps: list[list[float | None]] = [[None] * len(c) for c in cands]
    bounds = [[float(opened.first[b, c[0]]) for c in row] for b, row in enumerate(cands)]
    key = lambda i, lp: scales[i] * lp + offsets[i]  # noqa: E731
    for b, row in enumerate(cands):  # single-token labels are complete already
        for i, c in enumerate(row):
            if len(c) == 1:
                lps[b][i] = bounds[b][i]
    top = {b: sorted(range(len(row)), key=lambda i: -key(i, bounds[b][i]))[:FIRST] for b, row in enumerate(cands)}
    _complete(opened, cands, lps, top)
    _complete(opened, cands, lps, {b: _in_race(lps[b], bounds[b], key) for b in range(len(cands))})
    if threshold is not None:
        unsure = {b: [i for i, v in enumerate(lps[b]) if v is None] for b in range(len(cands))
                  if _winner_prob_floor(lps[b], bounds[b], key) < threshold + SLACK}
        _complete(opened, cands, lps, unsure)
    out = []
    for b in range(len(cands)):
        pruned = [i for i, v in enumerate(lps[b]) if v is None]
        out.append(Bounded([bounds[b][i] if v is None else v for i, v in enumerate(lps[b])], pruned))
    return out, opened.tokens


def _complete(opened, cands: list[list[tuple[int, ...]]], lps: list[list[float | None]],
              which: dict[int, Sequence[int]]) -> None:
    """Score the named labels of each item to the end (those not complete yet)."""
    chosen = {b: [i for i in idx if lps[b][i] is None] for b, idx in which.items()}
    chosen = {b: idx for b, idx in chosen.items() if idx}
    if not chosen:
        return
    scored = opened.branches({b: [cands[b][i] for i in idx] for b, idx in chosen.items()})
    for b, idx in chosen.items():
        for i, value in zip(idx, scored[b]):
            lps[b][i] = value


def _best(lps: Sequence[float | None], key) -> tuple[int, float]:
    """The complete label with the highest key (ties: the first), and its key."""
    done = [(key(i, v), -i) for i, v in enumerate(lps) if v is not None]
    best, neg = max(done)
    return -neg, best


def _in_race(lps: Sequence[float | None], bounds: Sequence[float], key) -> list[int]:
    """Incomplete labels that could still win: their bound reaches the best complete key (a tie
    may win from an earlier position)."""
    _, best = _best(lps, key)
    return [i for i, v in enumerate(lps) if v is None and key(i, bounds[i]) >= best - SLACK]


def _winner_prob_floor(lps: Sequence[float | None], bounds: Sequence[float], key) -> float:
    """The winner's probability with every pruned label at its bound: at most the true one."""
    winner, best = _best(lps, key)
    keys = [key(i, bounds[i] if v is None else v) for i, v in enumerate(lps)]
    top = max(keys)
    return math.exp(best - top) / sum(math.exp(k - top) for k in keys)
