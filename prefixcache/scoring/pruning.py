"""Pruned scoring: the argmax of many labels (or a choice question's many options) at the cost of
a few, with every reported probability as exact as full scoring's.

Every candidate's first scored token is scored from the logits at the item's end (for a typed
question: at its question's end). A candidate's summed log-prob only falls as its tokens are
added, so after its first token `scale * logprob + offset` (decision.linear_keys: the
normalisation and calibration as a ranking key) bounds its final key from above. Per batch:

1. the items' own tokens go through the model once (the engine's `open_items`); then, in one pass, the
   questions' texts and every question the race does not prune (not a choice question, or one
   whose options have several texts), giving every raced candidate its first-token bound;
2. in each contest (the label set, or one choice question) the few candidates with the highest
   bounds are scored to the end;
3. every other candidate whose bound is below the best complete key can never win and is left at
   its bound (with `Contest.mass`, only while the candidates so bounded hold a negligible share of
   the probability, below); the candidates still in the race are scored one token deeper, which
   tightens their bounds, for DEEPEN steps, and those still in the race then are scored to the
   end (a pass reads every weight whatever its size: many short steps cost more than they save).
   Each pass runs only new trie nodes (the kept keys and
   values of the item and of every node run before are attended to, never run again), so a race
   never costs more tokens than full scoring, however little it prunes. Every decision is the
   item's own: its values do not depend on the batch it is scored in;
4. with a `threshold`, the winner's probability is checked against it with the bounded candidates
   at their bounds (a lower bound of the probability); when that cannot settle abstention, they
   are scored to the end too.

Two races (`Contest.mass`). The fast one (`--prune on`, mass None) leaves a candidate as soon as
it cannot win: the decision (argmax, abstention) and the winner's log-prob are exactly those of
full scoring, and the other probabilities are computed with the candidates left at their bounds
(the winner's is then a lower bound of its true value). The exact one (`--prune exact`, mass
MASS = 1e-5) leaves a candidate only while every candidate left at its bound together holds at
most MASS of the probability, at their bounds, in each distribution a record reports (the
decision's, and the raw one when calibrated): every reported probability is then within about
MASS of full scoring's (a complete candidate's differs only through the bounded candidates' share
of the total, and a bounded one's own is at most that share), which a confident model's
candidates reach at their first token and a flat distribution's rarely do. Either way a bounded
candidate's log-prob is its value over the tokens scored before it left the race, an upper
bound, and `Bounded.pruned` says which.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from ..model.protocol import OpenedItems, PrefixHandle, ScoringEngine
from ..model.rows import Node
from ..task.decision import Bounded
from .prepare import Prepared

DEEPEN = 2  # race steps that go one token deeper; the candidates still racing after them are scored to the end
FIRST = 4  # candidates of a contest scored to the end before pruning: the highest first-token bounds
SLACK = 1e-9  # a bound must fall this far below the best key to prune (no float ties decide)
MASS = 1e-5  # the most probability all candidates left at their bounds may hold, in every reported distribution
Keys = tuple[Sequence[float], Sequence[float]]  # per candidate, (scale, offset): decision.linear_keys


@dataclass(frozen=True)
class Contest:
    """Candidates decided together: a task's labels, or one typed question's answers. `at`, `end`:
    their span of each row's candidates; `skip`: leading ids of each that are read, not scored
    (the question's text); `keys`: per reported distribution (the decision's first, then the raw
    one when calibrated) each candidate's (scale, offset); `threshold`: the decision's abstention
    threshold; `race`: False scores every candidate to the end (nothing is pruned); `mass`: the
    most probability the candidates left at their bounds may hold (None: any, a candidate leaves
    as soon as it cannot win)."""

    at: int
    end: int
    skip: int = 0
    keys: Sequence[Keys] = ()
    threshold: float | None = None
    race: bool = True
    mass: float | None = None


def score_pruned(engine: ScoringEngine, prefix: PrefixHandle, preps: Sequence[Prepared], contests: Sequence[Contest]) -> list[Bounded]:
    """Each item's candidate log-probs, in candidate order (those left at their bounds: upper
    bounds, named by `Bounded.pruned`). The engine opens the items in groups it can keep at once
    (one on transformers; on llama.cpp as many as its sequences hold), each raced in turn."""
    out: list[Bounded] = []
    groups = engine.open_items(prefix, [p.row for p in preps])
    try:
        for opened in groups:
            out += _race(_Race(opened, contests), contests)
    finally:
        getattr(groups, "close", lambda: None)()  # a group's kept tokens freed even when a pass fails
    return out


def _race(race: "_Race", contests: Sequence[Contest]) -> list[Bounded]:
    raced = [c for c in contests if c.race]
    race.feed({b: [race.cands[b][c.at][:c.skip] for c in raced if c.skip]
               + [race.cands[b][i][:-1] for c in contests if not c.race for i in range(c.at, c.end)] for b in race.items})
    race.feed({b: [race.cands[b][i][:-1] for c in raced for i in race.top(b, c, FIRST)] for b in race.items})
    for step in itertools.count():  # each item's candidates still in the race, one token deeper (or to the end)
        deeper = {b: race.deeper(b, [i for c in raced for i in race.in_race(b, c)], step) for b in race.items}
        deeper = {b: nodes for b, nodes in deeper.items() if nodes}
        if not deeper:
            break
        race.feed(deeper)
    race.feed({b: [race.cands[b][i][:-1] for c in raced if c.threshold is not None and race.unsettled(b, c)
                   for i in race.open(b, c)] for b in race.items})
    return [race.result(b) for b in race.items]


class _Race:
    """Per item, each candidate's scored depth and the log-probs of the trie nodes fed so far: a
    candidate's log-prob over its tokens scored so far is the final one when `depth` is its
    length, else an upper bound of it."""

    def __init__(self, opened: OpenedItems, contests: Sequence[Contest]):
        self.opened, self.contests = opened, contests
        self.items = range(len(opened.rows))
        self.cands = [[tuple(c) for c in row.candidates] for row in opened.rows]
        self.tok = [opened.firsts(b) for b in self.items]  # node -> log-prob of its last token
        skips = [0] * max((c.end for c in contests), default=0)
        for c in contests:
            skips[c.at: c.end] = [c.skip] * (c.end - c.at)
        # a candidate's depth starts after its question's text, which is read, never scored
        self.depth = [list(skips[: len(row)]) for row in self.cands]
        self.lps = [[0.0] * len(row) for row in self.cands]  # summed over the scored tokens up to `depth`
        for b in self.items:
            self._advance(b)

    def feed(self, nodes: dict[int, list[Node]]) -> None:
        for b, found in self.opened.feed({b: ns for b, ns in nodes.items() if ns}).items():
            self.tok[b].update(found)
            self._advance(b)

    def _advance(self, b: int) -> None:
        """Each candidate as deep as the known log-probs reach, its sum over them added up."""
        known = self.tok[b]
        for i, cand in enumerate(self.cands[b]):
            d, total = self.depth[b][i], self.lps[b][i]
            while d < len(cand):
                value = known.get(cand[:d + 1])
                if value is None:
                    break
                d, total = d + 1, total + value
            self.depth[b][i], self.lps[b][i] = d, total

    def deeper(self, b: int, racing: Sequence[int], step: int) -> list[Node]:
        """The nodes item b feeds next: its racing candidates one token deeper, or, from step
        DEEPEN on, to the end: a pass costs a read of every weight whatever its size, so a race
        of many short steps costs more than the tokens it saves."""
        if step >= DEEPEN:
            return [self.cands[b][i][:-1] for i in racing]
        return [self.cands[b][i][:self.depth[b][i]] for i in racing]

    def keys(self, b: int, c: Contest, which: int = 0) -> list[float]:
        scales, offsets = c.keys[which]
        lps = self.lps[b]
        return [scales[j] * lps[i] + offsets[j] for j, i in enumerate(range(c.at, c.end))]

    def complete(self, b: int, i: int) -> bool:
        return self.depth[b][i] == len(self.cands[b][i])

    def open(self, b: int, c: Contest) -> list[int]:
        return [i for i in range(c.at, c.end) if not self.complete(b, i)]

    def top(self, b: int, c: Contest, n: int) -> list[int]:
        keys = self.keys(b, c)
        return sorted(range(c.at, c.end), key=lambda i: -keys[i - c.at])[:n]

    def best(self, b: int, c: Contest) -> tuple[int, float] | None:
        """The complete candidate with the highest key (ties: the first), and its key."""
        keys = self.keys(b, c)
        done = [(keys[i - c.at], -i) for i in range(c.at, c.end) if self.complete(b, i)]
        if not done:
            return None
        top, neg = max(done)
        return -neg, top

    def in_race(self, b: int, c: Contest) -> list[int]:
        """Incomplete candidates still racing: those that could still win (their bound reaches the
        best complete key; a tie may win from an earlier position), and those whose probability
        could still matter (`Contest.mass`): the incomplete candidates left at their bounds may
        hold at most that share of the probability, in every distribution a record reports, so
        that every reported probability is within about as much of full scoring's."""
        found, open_ = self.best(b, c), self.open(b, c)
        keys = self.keys(b, c)
        racing = {i for i in open_ if found is None or keys[i - c.at] >= found[1] - SLACK}
        mass = c.mass
        for which in range(len(c.keys) if mass is not None else 0):
            keys = self.keys(b, c, which)
            top = max(keys)
            total = sum(math.exp(k - top) for k in keys)
            held = 0.0
            for i in sorted(open_, key=lambda i: keys[i - c.at]):  # the least probable stay at their bounds first
                held += math.exp(keys[i - c.at] - top)
                if mass is not None and held > mass * total:
                    racing.update(j for j in open_ if keys[j - c.at] >= keys[i - c.at])
                    break
        return sorted(racing)

    def unsettled(self, b: int, c: Contest) -> bool:
        """Whether the winner's probability, with every incomplete candidate at its bound (at most
        the true one), falls short of the threshold: abstention is then not settled."""
        found = self.best(b, c)
        if c.threshold is None:
            return False  # nothing to abstain below
        if found is None:
            return True  # no candidate is complete yet
        _, best = found
        keys = self.keys(b, c)
        top = max(keys)
        return math.exp(best - top) / sum(math.exp(k - top) for k in keys) < c.threshold + SLACK

    def result(self, b: int) -> Bounded:
        return Bounded(list(self.lps[b]), [i for c in self.contests for i in self.open(b, c)])
