"""How often each question of a pack got each answer, across requests: a choice or yes/no
question that gives one answer to nearly every state usually means a model biased toward it, not
such states. The server and `decide` say so once per pack and question, as `run` does at its end
for a spec's questions (the same share and count, task/kind.py)."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any, Mapping, Sequence

from ..task.kind import COLLAPSE_MIN_ITEMS, COLLAPSE_SHARE, Question

log = logging.getLogger("prefixcache")


class AnswerTally:
    """Per pack (the canonical JSON of its instructions and questions) and question id, the answers
    given. `packs`: how many packs are counted at once (the oldest is forgotten first)."""

    def __init__(self, packs: int):
        self.packs = packs
        self._counts: OrderedDict[str, dict[str, Counter]] = OrderedDict()
        self._warned: set[tuple[str, str]] = set()

    def add(self, pack: str, questions: Sequence[Question], answers: Mapping[str, Mapping[str, Any]]) -> None:
        """Count one request's answers; warn the first time one answer holds COLLAPSE_SHARE of at
        least COLLAPSE_MIN_ITEMS requests of a question."""
        counts = self._counts.setdefault(pack, {})
        self._counts.move_to_end(pack)
        while len(self._counts) > self.packs:
            gone, _ = self._counts.popitem(last=False)
            self._warned = {w for w in self._warned if w[0] != gone}
        for q in questions:
            answer = answers.get(q.id) or {}
            if not q.kind.collapses or q.type not in answer:
                continue
            mine = counts.setdefault(q.id, Counter())
            mine[str(answer[q.type])] += 1
            self._check(pack, q, mine)

    def _check(self, pack: str, q: Question, mine: Counter) -> None:
        total = sum(mine.values())
        if total < COLLAPSE_MIN_ITEMS or (pack, q.id) in self._warned:
            return
        word, n = mine.most_common(1)[0]
        if n / total >= COLLAPSE_SHARE:
            self._warned.add((pack, q.id))
            log.warning("%.0f%% of the requests (%d of %d) got %r for question %r: unless the states are that alike, "
                        "the model favours it whatever the state; %s, and check it on labelled states",
                        100 * n / total, n, total, word, q.id,
                        "it is calibrated already: try other instructions or another model (-m)" if q.content_free
                        else "try \"calibrate\": true on the question")
