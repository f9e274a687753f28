"""Pruned label scoring: the argmax of many labels at the cost of a few.

Every label's first token is scored from the same logits row, at the item's last position. A
label's summed log-prob only falls as its tokens are added, so after its first token
`scale * logprob + offset` (decision.linear_keys: the spec's normalisation and calibration as a
ranking key) bounds its final key from above. Per batch:

1. the items' own tokens go through the model once (model/branches.py), giving every label's
   first-token bound;
2. the few labels with the highest bounds are scored to the end;
3. every other label whose bound is below the best complete key can never win, and while the
   labels so bounded hold a negligible share of the probability (below) they are pruned;
   the labels still in the race are scored one token deeper (labels sharing leading tokens share
   the trie nodes), which tightens their bounds, and pruned again, until none is left. Each step
   scores a label's tokens so far again, so an item's race is scored to the end instead as soon
   as the steps taken and the next one would cost what that costs (a race that prunes little
   costs at most about twice that, never a multiple of it). Every decision is the item's own:
   its values do not depend on the batch it is scored in;
4. with a `threshold`, the winner's probability is checked against it with the pruned labels at
   their bounds (a lower bound of the probability); when that cannot settle abstention, the
   pruned labels are scored to the end too.

A label leaves the race only while every label left at its bound together holds at most MASS
(1e-5) of the probability, at their bounds, in each distribution a record reports (the decision's,
and the raw one when calibrated). So the decision (argmax, abstention) is exactly that of full
scoring, and every reported probability is within about MASS of it: a complete label's differs
only through the bounded labels' share of the total, and a pruned label's own is at most that
share. A pruned label's log-prob is its value over the tokens scored before it was pruned, an
upper bound, and `Bounded.pruned` says which.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..model.branches import open_items
from ..model.engine import Engine, Prefix
from ..model.rows import trie
from ..task.decision import Bounded
from .prepare import Prepared

FIRST = 4  # labels scored to the end before pruning: the highest first-token bounds
SLACK = 1e-9  # a bound must fall this far below the best key to prune (no float ties decide)
MASS = 1e-5  # the most probability all labels left at their bounds may hold, in every reported distribution
Keys = tuple[Sequence[float], Sequence[float]]  # per label, (scale, offset): decision.linear_keys


def score_pruned(engine: Engine, prefix: Prefix, preps: Sequence[Prepared], keys: Sequence[Keys],
                 threshold: float | None) -> list[Bounded]:
    """Each item's label log-probs (pruned ones as bounds). `keys`: the decision's (scales,
    offsets), then with calibration the raw distribution's: every distribution a record reports."""
    opened = open_items(engine, prefix, [p.row for p in preps])
    race = _Race(opened, [list(p.candidates.values()) for p in preps], keys)
    race.deepen({b: race.top(b, FIRST) for b in race.items}, full=set(race.items))
    while True:  # best-first: each item's labels still in the race one token deeper, or to the end
        racing = {b: race.in_race(b) for b in race.items}
        racing = {b: idx for b, idx in racing.items() if idx}
        if not racing:
            break
        race.deepen(racing, full={b for b, idx in racing.items() if race.finishes(b, idx)})
    if threshold is not None:
        race.deepen({b: race.open_labels(b) for b in race.items if race.winner_prob_floor(b) < threshold + SLACK},
                    full=set(race.items))
    return [race.result(b) for b in race.items]


class _Race:
    """Per item, each label's log-prob over its tokens scored so far (`depth`): the final one when
    `depth` is its length, else an upper bound of it."""

    def __init__(self, opened, cands: list[list[tuple[int, ...]]], keys: Sequence[Keys]):
        self.opened, self.cands, self.keysets = opened, cands, keys
        self.scales, self.offsets = keys[0]  # the decision's
        self.items = range(len(cands))
        self.lps = [[float(opened.first[b, c[0]]) for c in row] for b, row in enumerate(cands)]
        self.depth = [[1] * len(row) for row in cands]
        self.stepped = [0] * len(cands)  # label tokens the steps one token deeper have run, per item

    def key(self, i: int, lp: float) -> float:
        return self.scales[i] * lp + self.offsets[i]

    def complete(self, b: int, i: int) -> bool:
        return self.depth[b][i] == len(self.cands[b][i])

    def open_labels(self, b: int) -> list[int]:
        return [i for i in range(len(self.cands[b])) if not self.complete(b, i)]

    def top(self, b: int, n: int) -> list[int]:
        return sorted(range(len(self.cands[b])), key=lambda i: -self.key(i, self.lps[b][i]))[:n]

    def deepen(self, which: dict[int, Sequence[int]], full: set[int] | frozenset = frozenset()) -> None:
        """Score the named labels one token deeper (items in `full`: to the end), in one forward pass."""
        chosen = {b: [i for i in idx if not self.complete(b, i)] for b, idx in which.items()}
        chosen = {b: idx for b, idx in chosen.items() if idx}
        if not chosen:
            return
        until = {b: [len(self.cands[b][i]) if b in full else self.depth[b][i] + 1 for i in idx]
                 for b, idx in chosen.items()}
        cut = {b: [self.cands[b][i][:d] for i, d in zip(idx, until[b])] for b, idx in chosen.items()}
        scored = self.opened.branches(cut)
        for b, idx in chosen.items():
            if b not in full:
                self.stepped[b] += len(trie(cut[b]))
            for i, d, value in zip(idx, until[b], scored[b]):
                self.lps[b][i], self.depth[b][i] = value, d

    def finishes(self, b: int, idx: Sequence[int]) -> bool:
        """Whether item b's labels still in the race (`idx`) are scored to the end now rather than
        one token deeper: once the steps taken and the next one would cost what finishing them
        costs (so a race that prunes little costs at most about twice that, never a multiple)."""
        step = len(trie([self.cands[b][i][:self.depth[b][i] + 1] for i in idx]))
        return self.stepped[b] + step >= len(trie([self.cands[b][i] for i in idx]))

    def best(self, b: int) -> tuple[int, float] | None:
        """The complete label with the highest key (ties: the first), and its key."""
        done = [(self.key(i, v), -i) for i, v in enumerate(self.lps[b]) if self.complete(b, i)]
        if not done:
            return None
        top, neg = max(done)
        return -neg, top

    def in_race(self, b: int) -> list[int]:
        """Incomplete labels still racing: those that could still win (their bound reaches the best
        complete key; a tie may win from an earlier position), and those whose probability could
        still matter: the incomplete labels left at their bounds may hold at most MASS of the
        probability, in the decision's distribution and, when calibrated, the raw one, so that
        every reported probability is within about MASS of full scoring's."""
        found = self.best(b)
        open_ = self.open_labels(b)
        racing = {i for i in open_ if found is None or self.key(i, self.lps[b][i]) >= found[1] - SLACK}
        for scales, offsets in self.keysets:
            keys = [scale * lp + offset for scale, lp, offset in zip(scales, self.lps[b], offsets)]
            top = max(keys)
            total = sum(math.exp(k - top) for k in keys)
            held = 0.0
            for i in sorted(open_, key=keys.__getitem__):  # the least probable stay at their bounds first
                held += math.exp(keys[i] - top)
                if held > MASS * total:
                    racing.update(j for j in open_ if keys[j] >= keys[i])
                    break
        return sorted(racing)

    def winner_prob_floor(self, b: int) -> float:
        """The winner's probability with every incomplete label at its bound: at most the true one."""
        _, best = self.best(b)
        keys = [self.key(i, v) for i, v in enumerate(self.lps[b])]
        top = max(keys)
        return math.exp(best - top) / sum(math.exp(k - top) for k in keys)

    def result(self, b: int) -> Bounded:
        return Bounded(self.lps[b], self.open_labels(b))
