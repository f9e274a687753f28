"""fp32 answers at bf16 speed: score every item with a bfloat16 (or float16, int8) model, then
score again in float32 exactly the items whose decision the rounding could have changed.

An item's decision rests on the lead of its most probable candidate over the others, in
log-probability (after normalisation and calibration); with typed questions, each question's
decision on its own options' lead, and an item is as close as its closest question. Rounding shifts
each candidate relative to the favourite by some amount; the decision can change only where that
shift exceeds the lead. The bound is the largest shift measured on the input's first
CALIBRATION_ITEMS items, scored both ways, times SAFETY (never below FLOOR). Items whose
low-precision lead is below it are scored again in float32.

Which items are re-scored follows from the scores alone: the bound is measured once for a model,
precision, engine and task (scoring/bounds.py keeps it; the output's fingerprint too, for a run that
continues it) and never changes during a run, and no timing enters any decision. So the same run
gives the same records twice, in batches of any size, and stopped and resumed. The float32 twin is
loaded only when an item (or the measurement) needs it. What is promised: re-scored items' records
are float32 records; the others carry low-precision scores whose lead is at least SAFETY times the
largest shift measured. It is a measured bound, not a proof: a re-scored item that moved further
than the bound is counted and said.
"""

from __future__ import annotations

import logging
import math
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

from ..data.items import Item
from ..model.engines import twin_backend
from ..model.store import PrefixStore
from .bounds import BoundStore, bound_key
from .prepare import Batching, Prepared, Task
from .scorer import Rescoring, Scorer, Scores, check_fits
from ..task.questions import Answers

log = logging.getLogger(__name__)

SAFETY = 2.0  # the bound is this many times the largest rounding shift measured
FLOOR = 0.02  # never below this gap (in log-probability)
CALIBRATION_ITEMS = 32  # the input's first items the bound is measured on
TWIN_WHY = "--exact: the engine that loads a float32 twin"  # said for the engine --exact names


def bound_text(bound: float) -> str:
    """A gap bound in words."""
    return f"gap bound {bound:.3g}"


class CheckedScorer(Scorer):
    """A low-precision scorer whose close calls are scored again by a float32 one.

    Attributes (besides Scorer's): bound (the gap bound; None until measured or carried),
    rescored (items scored again in float32), checked (items scored in low precision),
    beyond (re-scored items that rounding moved further than the bound).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bound: float | None = None
        self.rescored = self.checked = self.beyond = 0
        self._precision: dict[tuple, str] = {}
        self._twin: Callable[[], Scorer] | None = None  # loads the float32 scorer
        self._exact: Scorer | None = None
        self._bounds: BoundStore | None = None
        self._key = ""

    @classmethod
    def pair(cls, task: Task, cache_dir: Path, device: str, dtype: str, store: PrefixStore | None = None
             ) -> "CheckedScorer":
        """The low-precision scorer, its bound when this task was measured before, and how to load
        its float32 twin (loaded when an item first needs it)."""
        twin = twin_backend().name
        fast = cls.load(task, cache_dir, device, dtype, store, says_precision=True, backend=twin, why=TWIN_WHY)
        check_fits(task, cache_dir, device, "float32", twin)  # beside it, before any item: never mid-run
        fast._twin = lambda: Scorer.load(task, cache_dir, device, "float32", store, backend=twin, why=TWIN_WHY)
        fast._bounds, fast._key = BoundStore(cache_dir), bound_key(task, fast.engine, fast.dtype)
        fast.bound = fast._bounds.get(fast._key)
        if fast.bound is not None:
            log.info("--exact: calls closer than %.3g (measured before for this model, precision and task) are "
                     "scored again in float32", fast.bound)
        return fast

    @property
    def exact(self) -> Scorer:
        """The float32 twin, loaded on first use."""
        if self._exact is None:
            if self._twin is None:
                raise RuntimeError("CheckedScorer without a float32 twin: build it with CheckedScorer.pair")
            log.info("--exact: loading the float32 twin")
            self._exact = self._twin()
        return self._exact

    def precision(self, key: tuple) -> str | None:
        return self._precision.get(key, self.dtype)

    def rescoring(self) -> Rescoring:
        return Rescoring(self.rescored, self.checked, self.bound or 0.0, self.beyond)

    def exact_bound(self) -> float | None:
        return self.bound

    def carry_bound(self, bound: float) -> bool:
        self.bound = bound
        return True

    def calibration_items(self) -> int:
        return 0 if self.bound is not None else CALIBRATION_ITEMS

    def calibrate(self, items: Iterable[Item]) -> None:
        """Measure the bound on `items` (the input's first ones), prepared and batched as by
        default whatever the run's batch options, unless it is known already."""
        if self.bound is not None:
            return
        batches = self.task.batches(islice(items, CALIBRATION_ITEMS), Batching(), self.context)
        preps = [[p for p in batch if isinstance(p, Prepared)] for batch in batches]
        if any(preps):
            self._measure([batch for batch in preps if batch])

    def _measure(self, batches: Sequence[Sequence[Prepared]]) -> float:
        """The bound from `batches` scored both ways, batch by batch (within the batch budget):
        SAFETY times the widest shift (at least FLOOR)."""
        widest, keys = 0.0, set[Hashable]()
        for preps in batches:
            low = super().score(preps).scored()
            high = self.exact.score(preps).scored()
            widest = max(widest, *(self._moved(prep, lows, highs) for prep, lows, highs in zip(preps, low, high,
                                                                                                strict=True)))
            keys.update(p.key for p in preps)
        # scores move with the items batched beside them: the run scores these items again in its
        # own batches, so that its records are those of a run that found the bound kept
        super().clear()
        self.exact.clear()
        self.bound = max(widest * SAFETY, FLOOR)
        log.info("--exact: rounding moved a call by at most %.3g on the first %d items; calls closer than %.3g are "
                 "scored again in float32", widest, len(keys), self.bound)
        if self._bounds is not None:
            self._bounds.put(self._key, self.bound, len(keys), widest)
        return self.bound

    def clear(self) -> None:
        """Forget earlier items' scores and counts (the bound, a property of the task, stays)."""
        super().clear()
        if self._exact is not None:
            self._exact.clear()
        self._precision.clear()
        self.rescored = self.checked = self.beyond = 0

    def score(self, preps: Sequence[Prepared], known: Mapping[tuple, list[float]] | None = None) -> Scores:
        if known is not None or not preps:
            return super().score(preps, known)  # scores read back from records: what was written stands
        bound = self.bound if self.bound is not None else self._measure([preps])  # not calibrated on the input's
        scores = super().score(preps)                                             # first items (the Python API): here
        fresh = {p.key: p for p in scores.computed}
        self.checked += len(fresh)
        close = []
        for key, prep in fresh.items():
            if self._gap(prep, self.scores_of(key)) < bound:
                close.append(prep)
            else:
                self._precision.pop(key, None)
        if close:
            self._rescore(close, bound)
        return Scores([self.scores_of(p.key) for p in preps], scores.computed)

    def _rescore(self, close: list[Prepared], bound: float) -> None:
        """Score `close` in float32 and keep those scores; count any that rounding moved further
        than the bound."""
        for prep, high in zip(close, self.exact.score(close).scored()):
            moved = self._moved(prep, self.scores_of(prep.key), high)
            if moved >= bound:
                self.beyond += 1
                if self.beyond == 1:
                    log.warning("--exact: rounding moved item %r by %.3g, more than the bound %.3g measured on the "
                                "first items: the calls of other items whose lead lies between may differ from "
                                "float32's (`bench --exact` counts them)", prep.item.id, moved, bound)
            self._scores.put(prep.key, list(high))
            self._precision[prep.key] = "float32"
        self.rescored += len(close)

    def _moved(self, prep: Prepared, low: Sequence[float], high: Sequence[float]) -> float:
        return self._shift(self._decision_logs(prep, low, self), self._decision_logs(prep, high, self.exact))

    def decide(self, prep: Prepared, logprobs: Sequence[float] | None) -> Answers:
        if self._precision.get(prep.key) == "float32":
            return self.exact.decide(prep, logprobs)  # float32 prior and unconditional scores too
        return super().decide(prep, logprobs)

    def _gap(self, prep: Prepared, logprobs: Sequence[float]) -> float:
        """The nearest any of the item's calls comes to changing: for each (a question's choice,
        a label set's, each tag's on or off), the log-probability between its two most likely
        candidates (inf with one) and, with a threshold, the distance of the top one from it
        (abstaining, or a tag turning on, is a call too)."""
        gaps = [math.inf]
        for logs, threshold in self._decision_logs(prep, logprobs, self):
            ranked = sorted(logs, reverse=True)
            gaps.append(ranked[0] - ranked[1] if len(ranked) > 1 else math.inf)
            if threshold is not None:
                gaps.append(abs(ranked[0] - threshold))
        return min(gaps)

    def _shift(self, low: list[tuple[list[float], float | None]], high: list[tuple[list[float], float | None]]) -> float:
        """How far rounding moved any candidate relative to its call's low-precision favourite:
        a call can change only if this exceeds the favourite's lead (with a threshold, also how
        far the favourite itself moved)."""
        widest = 0.0
        for (lows, threshold), (highs, _) in zip(low, high, strict=True):
            top = max(range(len(lows)), key=lows.__getitem__)
            widest = max(widest, *(abs((highs[i] - highs[top]) - (lows[i] - lows[top])) for i in range(len(lows))))
            if threshold is not None:
                widest = max(widest, abs(highs[top] - lows[top]))
        return widest

    @staticmethod
    def _decision_logs(prep: Prepared, logprobs: Sequence[float], scorer: Scorer) -> list[tuple[list[float], float | None]]:
        """Each call the item's scores make, with the log-threshold it is held to (each question
        asked says what its calls are)."""
        return Scorer.decide(scorer, prep, logprobs).decision_logs()
