"""fp32 answers at bf16 speed: score every batch with a bfloat16 (or float16) model, then score
again in float32 exactly the items whose decision the rounding could have changed.

An item's decision rests on the lead of its most probable candidate over the others, in
log-probability (after normalisation and calibration); with typed questions, each question's
decision on its own options' lead, and an item is as close as its closest question. Rounding shifts each candidate relative to
the favourite by some amount; the decision can change only where that shift exceeds the lead. The
bound is the largest shift measured, times SAFETY: the first batch is scored both ways, every item
re-scored afterwards shows its own shift, and the bound widens when one exceeds it. Items whose
low-precision lead is below the bound are scored again in float32. What is promised:
re-scored items' records are float32 records; the others carry low-precision scores whose
decision, by that measurement, matches float32's. It is a measured bound, not a proof.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Mapping, Sequence

from .scorer import Rescoring, Scorer, Scores
from ..task.questions import Answers
from ..model.engines import twin_backend
from ..model.store import PrefixStore
from .prepare import Prepared, Task

log = logging.getLogger(__name__)

SAFETY = 2.0  # the bound is this many times the largest rounding shift measured
FLOOR = 0.02  # never below this gap (in log-probability)
PAYS = 0.8  # the low-precision pass and its re-scoring must cost at most this share of float32 alone
TWIN_WHY = "--exact: the engine that loads a float32 twin"  # said for the engine --exact names
FLOAT32_ONLY = 1e9  # the bound that means: every call is close, so items are scored in float32 alone


def bound_text(bound: float) -> str:
    """A gap bound in words: its value, or that items are scored in float32 alone."""
    return "then float32 alone (the low-precision pass did not pay)" if bound >= FLOAT32_ONLY \
        else f"gap bound {bound:.3g}"


class CheckedScorer(Scorer):
    """A low-precision scorer whose close calls are scored again by a float32 one.

    Attributes (besides Scorer's): exact (the float32 Scorer), bound (the current gap bound),
    rescored (items scored again in float32), checked (items scored in low precision).
    """

    exact: Scorer

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bound: float | None = None  # set by the first batch
        self.rescored = self.checked = 0
        self._float32_s = 0.0  # float32 alone per item, measured on the first batch
        self._spent_s = 0.0  # after the first batch: the low-precision passes and their re-scoring
        self._first_items = 0  # the first batch's items (all re-scored: the measurement)
        self._precision: dict[tuple, str] = {}

    @classmethod
    def pair(cls, task: Task, cache_dir: Path, device: str, dtype: str, store: PrefixStore | None = None
             ) -> "CheckedScorer":
        """The low-precision scorer and its float32 twin (both models in memory; each prefix
        prefilled, or loaded from the store, once)."""
        twin = twin_backend().name
        fast = cls.load(task, cache_dir, device, dtype, store, says_precision=True, backend=twin, why=TWIN_WHY)
        fast.exact = Scorer.load(task, cache_dir, device, "float32", store, backend=twin, why=TWIN_WHY)
        return fast

    def precision(self, key: tuple) -> str | None:
        return self._precision.get(key, self.dtype)

    def rescoring(self) -> Rescoring:
        return Rescoring(self.rescored, self.checked, self.bound or 0.0)

    def exact_bound(self) -> float | None:
        return self.bound

    def carry_bound(self, bound: float) -> bool:
        self.bound = bound
        return True

    def clear(self) -> None:
        """Forget earlier items' scores and the measured bound: the next batch is measured anew."""
        super().clear()
        self.exact.clear()
        self._precision.clear()
        self.bound, self.rescored, self.checked = None, 0, 0
        self._float32_s = self._spent_s = 0.0
        self._first_items = 0

    def score(self, preps: Sequence[Prepared], known: Mapping[tuple, list[float]] | None = None) -> Scores:
        if self.bound is not None and self.bound >= FLOAT32_ONLY and known is None:
            return self._float32_only(preps)
        start = time.perf_counter()
        scores = super().score(preps, known)
        if known is not None or not preps:
            return scores  # scores read back from records: what was written stands
        spent = time.perf_counter() - start
        fresh = {p.key: p for p in scores.computed}
        self.checked += len(fresh)
        first = self.bound is None
        gaps = [self._gap(p, self._scores.peek(p.key)) for p in fresh.values()]
        close = list(fresh.values()) if first else [  # the first batch is measured both ways
            p for p, gap in zip(fresh.values(), gaps) if gap < self.bound]
        start = time.perf_counter()
        if close:
            self._rescore(close)
        rescoring = time.perf_counter() - start
        if first and fresh:
            self._float32_s, self._first_items = rescoring / len(fresh), len(fresh)  # float32 alone, per item
            # what the next batches would cost: the low-precision pass, and its calls closer than the bound
            # (judged on the low-precision scores this batch had before it was re-scored)
            share = sum(g < self.bound for g in gaps) / len(gaps)
            self._decide_pays(spent / len(fresh) / self._float32_s + share, share)
        else:
            self._spent_s += spent + rescoring
            self._pays_or_not()
        return Scores([self._scores.peek(p.key) for p in preps], scores.computed)

    def _pays_or_not(self) -> None:
        """After a later batch: whether the low-precision passes and their re-scoring so far cost
        less than PAYS of float32 alone (per item, as the first batch measured it)."""
        items = self.checked - self._first_items
        if self._float32_s and items > 0:
            self._decide_pays(self._spent_s / (items * self._float32_s), (self.rescored - self._first_items) / items)

    def _decide_pays(self, cost: float, share: float) -> None:
        """When `cost` (of float32 alone) is PAYS or more, every later item is scored in float32
        alone (said once; the bound that says so is kept in the output's fingerprint, so a run
        continued later does the same)."""
        if cost >= PAYS and self.bound is not None and self.bound < FLOAT32_ONLY:
            log.warning("--exact: %.0f%% of the calls are closer than this model's rounding can move them (bound %.3g), "
                        "and re-scoring them costs %.2fx float32 alone: the other items are scored in float32 alone",
                        100 * share, self.bound, cost)
            self.bound = FLOAT32_ONLY

    def _float32_only(self, preps: Sequence[Prepared]) -> Scores:
        """Score in float32 alone (the low-precision pass would not pay: `_pays_or_not`)."""
        todo = [p for p in preps if p.key not in self._scores]
        if todo:
            for prep, logprobs in zip(todo, self.exact.score(todo).logprobs):
                self._scores.put(prep.key, logprobs)
                self._precision[prep.key] = "float32"
            self.checked += len(todo)
            self.rescored += len(todo)
        return Scores([self._scores.get(p.key) for p in preps], todo)

    def _rescore(self, close: list[Prepared]) -> None:
        exact = self.exact.score(close)
        widest = 0.0
        for prep, logprobs in zip(close, exact.logprobs):
            low = self._decision_logs(prep, self._scores.peek(prep.key), self)
            high = self._decision_logs(prep, logprobs, self.exact)
            widest = max(widest, self._shift(low, high))
            self._scores.put(prep.key, logprobs)
            self._precision[prep.key] = "float32"
        self.rescored += len(close)
        needed = max(widest * SAFETY, FLOOR)
        if self.bound is None or needed > self.bound:
            if self.bound is not None:
                log.warning("rounding moved a score by %.3g, more than measured before: the re-scoring bound "
                            "widens from %.3g to %.3g", widest, self.bound, needed)
            self.bound = needed

    def decide(self, prep: Prepared, logprobs: Sequence[float]) -> Answers:
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
