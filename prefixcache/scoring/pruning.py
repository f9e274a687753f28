"""Pruned label scoring: the argmax of many labels at the cost of a few.

Every label's first token is scored from the same logits row, at the item's last position. A
label's summed log-prob only falls as its tokens are added, so after its first token
`scale * logprob + offset` (decision.linear_keys: the spec's normalisation and calibration as a
ranking key) bounds its final key from above. Per batch:

1. the items' own tokens go through the model once (model/branches.py), giving every label's
   first-token bound;
2. the few labels with the highest bounds are scored to the end;
3. every other label whose bound is below the best complete key can never win: it is pruned;
   the labels still in the race are scored one token deeper (labels sharing leading tokens share
   the trie nodes), which tightens their bounds, and pruned again, until none is left. Each step
   scores a label's tokens so far again, so a race that prunes little would cost far more than
   scoring every label once: as soon as the tokens of the steps taken and the next one reach what
   scoring the labels still in the race to the end costs, they are scored to the end instead
   (at most about twice what that would have cost from the start, and never quadratic);
4. with a `threshold`, the winner's probability is checked against it with the pruned labels at
   their bounds (a lower bound of the probability); when that cannot settle abstention, the
   pruned labels are scored to the end too.

The decision (argmax, abstention) and the winner's log-prob are exactly those of full scoring; a
pruned label's value is its log-prob over the tokens scored before it was pruned, an upper bound,
and `Bounded.pruned` says which.
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
                 offsets: Sequence[float], threshold: float | None) -> list[Bounded]:
    """Each item's label log-probs (pruned ones as bounds)."""
    opened = open_items(engine, prefix, [p.row for p in preps])
    race = _Race(opened, [list(p.candidates.values()) for p in preps], scales, offsets)
    race.deepen({b: race.top(b, FIRST) for b in race.items}, full=True)
    spent = 0  # label tokens the deepening steps scored
    while True:  # best-first: every label still in the race one token deeper, until none is left
        racing = {b: race.in_race(b) for b in race.items}
        racing = {b: idx for b, idx in racing.items() if idx}
        if not racing:
            break
        step, finish = race.step_cost(racing), race.finish_cost(racing)
        if spent + step >= finish:  # deepening would cost more than finishing: finish
            race.deepen(racing, full=True)
            break
        race.deepen(racing)
        spent += step
    if threshold is not None:
        race.deepen({b: race.open_labels(b) for b in race.items if race.winner_prob_floor(b) < threshold + SLACK},
                    full=True)
    return [race.result(b) for b in race.items]


class _Race:
    """Per item, each label's log-prob over its tokens scored so far (`depth`): the final one when
    `depth` is its length, else an upper bound of it."""

    def __init__(self, opened, cands: list[list[tuple[int, ...]]], scales: Sequence[float], offsets: Sequence[float]):
        self.opened, self.cands, self.scales, self.offsets = opened, cands, scales, offsets
        self.items = range(len(cands))
        self.lps = [[float(opened.first[b, c[0]]) for c in row] for b, row in enumerate(cands)]
        self.depth = [[1] * len(row) for row in cands]

    def key(self, i: int, lp: float) -> float:
        return self.scales[i] * lp + self.offsets[i]

    def complete(self, b: int, i: int) -> bool:
        return self.depth[b][i] == len(self.cands[b][i])

    def open_labels(self, b: int) -> list[int]:
        return [i for i in range(len(self.cands[b])) if not self.complete(b, i)]

    def top(self, b: int, n: int) -> list[int]:
        return sorted(range(len(self.cands[b])), key=lambda i: -self.key(i, self.lps[b][i]))[:n]

    def deepen(self, which: dict[int, Sequence[int]], full: bool = False) -> None:
        """Score the named labels one token deeper (`full`: to the end), in one forward pass."""
        chosen = {b: [i for i in idx if not self.complete(b, i)] for b, idx in which.items()}
        chosen = {b: idx for b, idx in chosen.items() if idx}
        if not chosen:
            return
        until = {b: [len(self.cands[b][i]) if full else self.depth[b][i] + 1 for i in idx] for b, idx in chosen.items()}
        scored = self.opened.branches({b: [self.cands[b][i][:d] for i, d in zip(idx, until[b])]
                                       for b, idx in chosen.items()})
        for b, idx in chosen.items():
            for i, d, value in zip(idx, until[b], scored[b]):
                self.lps[b][i], self.depth[b][i] = value, d

    def step_cost(self, which: dict[int, Sequence[int]]) -> int:
        """Label tokens one step deeper scores (each label's tokens so far, and one more)."""
        return sum(self.depth[b][i] + 1 for b, idx in which.items() for i in idx)

    def finish_cost(self, which: dict[int, Sequence[int]]) -> int:
        """Label tokens scoring the named labels to the end costs."""
        return sum(len(self.cands[b][i]) for b, idx in which.items() for i in idx)

    def best(self, b: int) -> tuple[int, float] | None:
        """The complete label with the highest key (ties: the first), and its key."""
        done = [(self.key(i, v), -i) for i, v in enumerate(self.lps[b]) if self.complete(b, i)]
        if not done:
            return None
        top, neg = max(done)
        return -neg, top

    def in_race(self, b: int) -> list[int]:
        """Incomplete labels that could still win: their bound reaches the best complete key (a
        tie may win from an earlier position)."""
        found = self.best(b)
        return [i for i in self.open_labels(b) if found is None or self.key(i, self.lps[b][i]) >= found[1] - SLACK]

    def winner_prob_floor(self, b: int) -> float:
        """The winner's probability with every incomplete label at its bound: at most the true one."""
        _, best = self.best(b)
        keys = [self.key(i, v) for i, v in enumerate(self.lps[b])]
        top = max(keys)
        return math.exp(best - top) / sum(math.exp(k - top) for k in keys)

    def result(self, b: int) -> Bounded:
        return Bounded(self.lps[b], self.open_labels(b))
