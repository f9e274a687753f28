"""Judging `fit`'s readouts honestly against the prompt rule, and the head that runs. No torch here.

One question's labelled data (`Labelled`, labelled/data.py) holds, per item, the final hidden
state at its answer position(s), its options' prompt log-probabilities, its gold option(s) and
what the prompt rule decided. A readout (labelled/readouts.py) is a standardised logistic
regression (multinomial over the options, or one binary per tag), its regularisation C and
features chosen by an inner cross-validation by log-loss. What the rows themselves call for
(refusals, copies, rows `suggest` picked, likely label errors) is labelled/hygiene.py. Every figure is
held out: in k-fold cross-validation each fold is predicted by a readout chosen and fitted on the
other folds, and the prompt rule is measured on the same items, paired, with bootstrap intervals
(tune/selection.py owns the folds and the intervals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..task.head import Readout
from ..task.reliability import fitted_reliability
from ..task.scoring_metrics import calibration_error
from .data import Choice, Labelled
from .hygiene import check_counts, fold_copies_together, likely_errors, once_a_text, representative, suspects_note
from .readouts import FEATURE_SETS, INNER_FOLDS, choose, fitted_probs, readout
from .cutpoint import CONFIDENCE, Cut, Row, bounds, choose_cut, least_items, per_option_cuts, risk_coverage
from ..reports.resampling import GAIN_LEVEL, LEVEL, Figure, cv_splits, interval, resamples

CURVE = (1, 2, 4, 8, 16, 32)  # labelled items a class in the learning curve


@dataclass(frozen=True)
class Asked:
    """The cut-point asked of fit: a target accuracy or a coverage, at a confidence."""

    target: float | None = None
    coverage: float | None = None
    confidence: float = CONFIDENCE


@dataclass(frozen=True)
class Since:
    """The last fit beside this one on this fit's folds: each fold's readout fitted on the training
    items the last fit had (`items` of them in all) against one fitted on all of them, the same
    held-out items judging both."""

    items: int
    accuracy: Figure  # held out, fitted on the last fit's items only
    gain: Figure  # this fit's accuracy minus that, paired (98%)

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "accuracy": self.accuracy.to_json(), "gain": self.gain.to_json()}


@dataclass
class Judged:
    """One question's held-out comparison of the head with the prompt rule."""

    qid: str
    binary: bool
    items: int
    folds: int
    head: dict[str, Figure | float | None]
    prompt: dict[str, Figure | float | None]
    gain: Figure  # accuracy (binary: exact sets) of the head minus the prompt's, paired
    verdict: str  # "head", "prompt" (the prompt is better), "tie" (no difference beyond noise)
    choice: Choice  # what the final readout uses (chosen on every item)
    counts: dict[str, int]
    curve: list[dict[str, Any]] = field(default_factory=list)
    thresholds: list[float] | None = None  # binary: each tag's, chosen on held-out probabilities
    notes: list[str] = field(default_factory=list)
    cut: Cut | None = None  # where the head abstains, chosen on held-out probabilities (--target-accuracy, --coverage)
    since: Since | None = None  # the new labels' gain over the last fit's, on the same folds
    coverage: list[Row] = field(default_factory=list)  # one answer: the risk-coverage table of the held-out predictions
    prompt_items: int = 0  # the items the prompt alone and the gain are measured on (its options scored)
    texts: int = 0  # the distinct texts every figure counts once (0: as many as items)
    unseen: int = 0  # held-out rows whose answer no row of their training folds had (a class of one row)
    suspects: list[dict[str, Any]] = field(default_factory=list)  # likely label errors (`likely_errors`)
    baseline: dict[str, Figure | float | None] | None = None  # TF-IDF + logistic regression on the same folds
    calibration: int = 0  # rows held out from the head that runs to certify its cut (a target asked)

    @property
    def verdict_words(self) -> str:
        """The verdict as the gain's interval allows: better or worse beyond noise, or not enough
        labels to tell, with about how many compared items would tell them apart at this gain."""
        g = self.gain
        if self.verdict == "head":
            return "the head is better beyond noise"
        if self.verdict == "prompt":
            return "the prompt alone is better beyond noise: keep the spec without 'head'"
        words = f"not enough labels to tell: the gain lies in [{g.low:+.3f}, {g.high:+.3f}]"
        if abs(g.value) < 0.01:
            return words + "; the two answer alike on these items"
        compared = self.prompt_items or self.items
        need = max(math.ceil(compared * ((g.high - g.low) / 2 / abs(g.value)) ** 2), compared + 1)
        if compared < self.items:
            more = f", and about {need - self.items} more labels" if need > self.items else ""
            return words + (f"; the prompt measured on about {need} items (--prompt-sample {min(need, self.items)}"
                            f"{more}) would tell them apart at this gain")
        return words + f"; about {need} labelled items ({need - compared} more) would tell them apart at this gain"

    @property
    def counted(self) -> str:
        """What the figures stand on, in words: "48 items (24 distinct texts)"."""
        return f"{self.items} items" + (f" ({self.texts} distinct texts)" if 0 < self.texts < self.items else "")

    def to_json(self) -> dict[str, Any]:
        def js(figures: dict) -> dict:
            return {k: (v.to_json() if isinstance(v, Figure) else v) for k, v in figures.items()}

        return {"question": self.qid, "kind": "tags" if self.binary else "one of", "items": self.items,
                "folds": self.folds, "head": js(self.head), "prompt": js(self.prompt), "gain": self.gain.to_json(),
                "prompt_items": self.prompt_items, "texts": self.texts or self.items, "likely_errors": self.suspects,
                "unseen_in_training": self.unseen,
                **({"tfidf_baseline": js(self.baseline)} if self.baseline else {}),
                "verdict": self.verdict, "verdict_words": self.verdict_words, "chosen": {"C": self.choice.C, "features": self.choice.features},
                "labelled_per_option": self.counts, "learning_curve": self.curve,
                **({"thresholds": dict(zip(self.counts, self.thresholds))} if self.thresholds else {}),
                **({"cut": self._cut_json()} if self.cut else {}),
                **({"since_last_fit": self.since.to_json()} if self.since else {}),
                **({"risk_coverage": [r.to_json() for r in self.coverage]} if self.coverage else {}),
                "notes": self.notes}

    def _cut_json(self) -> dict[str, Any]:
        assert self.cut is not None  # asked for where there is one
        out = self.cut.to_json()
        if "per_option" in out:  # by option name
            names = list(self.counts)
            out["per_option"] = {names[int(k)]: v for k, v in out["per_option"].items()}
        return out


# -- the held-out comparison -----------------------------------------------------------------------
def judge(data: Labelled, folds: int, seed: int, step: Callable[[int, int], None] = lambda done, total: None,
          asked: Asked | None = None, feature_sets: Sequence[str] = FEATURE_SETS,
          before: np.ndarray | None = None) -> tuple[Judged, Readout]:
    """Cross-validate the head beside the prompt rule on the same folds; then the readout fitted
    on every item (with the C and features chosen on every item). `asked`: a cut-point to choose
    on the held-out probabilities (a question of one answer; tags have their thresholds).
    `before` [N] bool: the items the last fit had; the gain of the new ones is measured on the same
    folds (`Judged.since`)."""
    notes = [*data.notes, *check_counts(data, folds)]
    folds = fold_copies_together(data, folds, notes)
    splits = cv_splits(data.strata(), folds, seed, data.groups)
    probs = np.empty(data.prompt.shape)
    earlier = np.empty(data.prompt.shape) if before is not None and 0 < before.sum() < data.n else None
    everything = np.arange(data.n)
    for f, (train, test) in enumerate(splits):
        step(f, folds + 1)
        chosen = choose(data, train, seed, feature_sets)
        probs[test] = fitted_probs(data, train, test, chosen.features, [chosen.C])[0]
        if earlier is not None and before is not None:  # the same fold's readout fitted on the last fit's items alone
            earlier[test] = fitted_probs(data, train[before[train]], test, chosen.features, [chosen.C])[0]
    step(folds, folds + 1)
    choice = choose(data, everything, seed, feature_sets)
    # Every figure, interval and cut counts a text once: copies (in one fold, so predicted alike)
    # would otherwise narrow the intervals and certify cuts as if they were more evidence.
    one = representative(data, once_a_text(data), notes)
    ev, probs = replace(data.subset(one), prompted=None if data.prompted is None else data.prompted[one]), probs[one]
    thresholds = _tag_thresholds(ev, probs) if data.binary else None
    head_said = probs >= np.asarray(thresholds) if data.binary else answered(probs, data.threshold)
    head = figures(ev, head_said, probs, seed)
    prompt, gain = _prompt_beside(ev, head_said, seed, notes)
    verdict = "head" if gain.low > 0 else "prompt" if gain.high < 0 else "tie"
    judged = Judged(data.qid, data.binary, data.n, len(splits), head, prompt, gain, verdict, choice, data.counts(),
                    notes=notes, thresholds=thresholds, prompt_items=len(ev.prompt_items), texts=len(one),
                    unseen=_unseen(data, splits, notes))
    if earlier is not None and before is not None:
        earlier = earlier[one]
        then = earlier >= np.asarray(thresholds) if data.binary else answered(earlier, data.threshold)
        judged.since = Since(int(before.sum()), accuracy_of(figures(ev, then, earlier, seed)),
                             paired_gain(ev, head_said, then, seed))
    final = None
    if not data.binary:
        _one_answer(judged, ev, probs, asked if asked is not None and asked.target is None else None)
        judged.curve = learning_curve(data, splits, choice, seed)
        if data.texts:
            base = tfidf_baseline(data, splits, seed)[one]
            judged.baseline = figures(ev, answered(base, data.threshold), base, seed)
        if asked is not None and asked.target is not None:
            final = _certified(judged, data, one, asked, seed, feature_sets)
    return judged, _with_reliability(final or readout(data, choice), ev, probs)


def _with_reliability(made: Readout, ev: Labelled, probs: np.ndarray) -> Readout:
    """A question of one answer's readout with what its answers' probabilities were worth held out."""
    if ev.binary:
        return made
    return replace(made, reliability=fitted_reliability(probs.max(axis=1), probs.argmax(axis=1) == ev.gold))


def _unseen(data: Labelled, splits: Sequence[tuple[np.ndarray, np.ndarray]], notes: list[str]) -> int:
    """Held-out rows whose answer no row of their training folds had (multiclass), noted."""
    unseen = 0 if data.binary else sum(int((~np.isin(data.gold[test], data.gold[train])).sum()) for train, test in splits)
    if unseen:
        notes.append(f"{unseen} of {data.n} rows were held out with no row of their answer in their training folds (a "
                     f"class of one row): no held-out readout could answer them, so the held-out figures count them "
                     f"wrong and understate the head" + (" by far: they do not estimate it; label two rows a class or "
                                                         "more" if 2 * unseen >= data.n else ""))
    return unseen


TFIDF_C = (10.0, 1.0, 100.0)  # the TF-IDF baseline's C, chosen fold by fold on its training rows (ties: the first)


def tfidf_baseline(data: Labelled, splits: Sequence[tuple[np.ndarray, np.ndarray]], seed: int = 0) -> np.ndarray:
    """Held-out probabilities [N, K] of TF-IDF (words and word pairs, sublinear) + logistic
    regression on the items' texts, fold by fold: what a model-free classifier answers on the same
    folds, beside the head. Its C is chosen in each fold by an inner cross-validation on that
    fold's training rows, as the head's is (a fixed C can understate it on larger sets), where
    every answer there has two rows or more."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    probs = np.zeros((data.n, len(data.options)))
    texts = np.asarray(data.texts, dtype=object)
    for train, test in splits:
        classes = np.unique(data.gold[train])
        if len(classes) < 2:
            probs[test, classes[0]] = 1.0
            continue
        vectors = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)
        x, y = vectors.fit_transform(texts[train]), data.gold[train]
        fitted = LogisticRegression(C=_tfidf_c(x, y, seed), max_iter=2000).fit(x, y)
        probs[np.ix_(test, fitted.classes_)] = fitted.predict_proba(vectors.transform(texts[test]))
    return probs


def _tfidf_c(x: Any, y: np.ndarray, seed: int) -> float:
    """The C of TFIDF_C whose inner folds of these rows answer most right (ties: the first, so that
    a few rows that cannot tell them apart keep the usual 10); 10 where an answer has a single row."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    fewest = int(np.unique(y, return_counts=True)[1].min())
    if fewest < 2:
        return 10.0
    inner = list(StratifiedKFold(n_splits=min(INNER_FOLDS, fewest), shuffle=True, random_state=seed).split(x, y))
    right = [sum(int((LogisticRegression(C=c, max_iter=2000).fit(x[a], y[a]).predict(x[b]) == y[b]).sum())
                 for a, b in inner) for c in TFIDF_C]
    return TFIDF_C[int(np.argmax(right))]


CALIBRATION = 0.3  # the share of the representative rows held out to certify a target's cut (at most half)


def calibration_rows(data: Labelled, rows: np.ndarray, target: float, confidence: float, seed: int) -> np.ndarray:
    """A seeded uniform share of `rows` (representative, a text once) held out from the head that
    runs to certify its cut: CALIBRATION of them, more (up to half) where that is too few for a
    perfect record to reach `target`."""
    share = min(0.5, max(CALIBRATION, least_items(target, confidence) / max(len(rows), 1)))
    count = max(1, min(len(rows) - 1, int(round(share * len(rows)))))
    return np.sort(np.random.default_rng(seed + 7).choice(rows, size=count, replace=False))


def _certified(judged: Judged, data: Labelled, rows: np.ndarray, asked: Asked, seed: int,
               feature_sets: Sequence[str]) -> Readout:
    """A target's cut certified on the head that runs: that head is chosen and fitted on every
    row but a calibration share (and their copies), and the cut is tested on its predictions for
    the calibration rows, which it never saw; the rows' exchangeability with new items makes the
    fixed-sequence bound hold for it. Returns that head (its per-answer cuts kept in it)."""
    assert asked.target is not None  # a cut is certified for a target
    cal = calibration_rows(data, rows, asked.target, asked.confidence, seed)
    held = set(cal.tolist()) if data.groups is None else set(data.groups[cal].tolist())
    train = np.array([i for i in range(data.n) if (i if data.groups is None else data.groups[i]) not in held])
    choice = choose(data, train, seed, feature_sets)
    probs = fitted_probs(data, train, cal, choice.features, [choice.C])[0]
    top, best, right = probs.max(axis=1), probs.argmax(axis=1), probs.argmax(axis=1) == data.gold[cal]
    judged.cut = per_option_cuts(choose_cut(top, right, asked.target, None, asked.confidence), top, best, right)
    judged.coverage = judged.cut.table
    judged.calibration = len(cal)
    judged.choice = choice  # what the head written reads (fit reports and its header name it)
    judged.notes.append(f"the cut is certified on {len(cal)} calibration rows held out from the head that runs, which "
                        f"is fitted on the other {len(train)} (its held-out figures above are those of heads fitted "
                        f"on every row, fold by fold)")
    final = readout(data.subset(train), choice)
    if judged.cut.per_option:  # the head file keeps them; the spec, the cut for the rest
        final = replace(final, cuts={data.options[k]: round(r.cut, 6) for k, r in judged.cut.per_option.items()})
    return final


def _one_answer(judged: Judged, ev: Labelled, probs: np.ndarray, asked: Asked | None) -> None:
    """A question of one answer's likely label errors, its cut (`asked`) and its risk-coverage
    table, from the held-out probabilities `probs` of the items `ev` (a text once)."""
    judged.suspects = likely_errors(ev, probs)
    if judged.suspects:
        judged.notes.append(suspects_note(judged.suspects))
    top, best = probs.max(axis=1), probs.argmax(axis=1)
    if asked is not None:
        judged.cut = per_option_cuts(choose_cut(top, best == ev.gold, asked.target, asked.coverage, asked.confidence),
                                     top, best, best == ev.gold)
    judged.coverage = judged.cut.table if judged.cut else risk_coverage(top, best == ev.gold)


def _prompt_beside(data: Labelled, head_said: np.ndarray, seed: int, notes: list[str]
                   ) -> tuple[dict[str, Figure | float | None], Figure]:
    """The prompt alone's figures and the head's gain over it, on the items whose options were
    scored (all, or the prompt's sample: noted)."""
    asked = data.prompt_items
    sub = data.subset(asked)
    if len(asked) < data.n:
        notes.append(f"the prompt alone is measured on {len(asked)} of the {data.n} items (a uniform sample: "
                     f"scoring every option of every item costs more than reading the states); the gain is on the "
                     f"same {len(asked)}")
    return figures(sub, sub.said, sub.prompt, seed), paired_gain(sub, head_said[asked], sub.said, seed)


def answered(probs: np.ndarray, threshold: float | None) -> np.ndarray:
    """Each item's most probable option, or -1 where its probability is below `threshold` (as
    `run` abstains with the spec's threshold)."""
    best = probs.argmax(axis=1)
    return best if threshold is None else np.where(probs.max(axis=1) >= threshold, best, -1)


def _tag_thresholds(data: Labelled, probs: np.ndarray) -> list[float]:
    """Each tag's threshold: the one of best F1 on its held-out probabilities (ties: nearest 0.5)."""
    grid = np.round(np.arange(0.05, 0.96, 0.05), 2)
    out = []
    for u in range(len(data.options)):
        g = data.gold[:, u]
        best = max(grid, key=lambda t: (_f1(probs[:, u] >= t, g), -abs(t - 0.5)))
        out.append(float(best))
    return out


def _f1(said: np.ndarray, gold: np.ndarray) -> float:
    tp, fp, fn = (said & gold).sum(), (said & ~gold).sum(), (~said & gold).sum()
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def _scores(data: Labelled, said: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
    """Accuracy (binary: exact sets) and macro-F1 under bootstrap weights [R, N]."""
    if data.binary:
        right = (said == data.gold).all(axis=1)
        on_said, on_gold = said, data.gold
    else:
        right = said == data.gold
        k = len(data.options)
        on_said = said[:, None] == np.arange(k)[None]
        on_gold = data.gold[:, None] == np.arange(k)[None]
    total = weights.sum(axis=1)
    tp = weights @ (on_said & on_gold)
    fp = weights @ (on_said & ~on_gold)
    fn = weights @ (~on_said & on_gold)
    seen = (tp + fp + fn) > 0  # classes in the gold or the answers of this resample
    f1 = np.where(seen, 2 * tp / np.maximum(2 * tp + fp + fn, 1e-12), 0.0)
    macro = f1.sum(axis=1) / np.maximum(seen.sum(axis=1), 1)
    return {"accuracy": (weights @ right) / total, "macro_f1": macro}


def accuracy_of(held_out: Mapping[str, Figure | float | None]) -> Figure:
    """The accuracy `figures` gives (always a figure with its interval)."""
    accuracy = held_out["accuracy"]
    assert isinstance(accuracy, Figure)
    return accuracy


def figures(data: Labelled, said: np.ndarray, probs: np.ndarray, seed: int) -> dict[str, Figure | float | None]:
    """Held-out accuracy and macro-F1 with their bootstrap intervals, and the calibration error."""
    point = {k: float(v[0]) for k, v in _scores(data, said, np.ones((1, data.n))).items()}
    draws: dict[str, list] = {"accuracy": [], "macro_f1": []}
    for w in resamples(data.n, seed):
        for k, v in _scores(data, said, w).items():
            draws[k].append(v)
    intervals = {k: interval(point[k], np.concatenate(draws[k]), LEVEL) for k in point}
    intervals["accuracy"] = _at_least_exact(intervals["accuracy"], data.n)
    out: dict[str, Figure | float | None] = dict(intervals)
    if data.binary:
        conf = np.where(said, probs, 1 - probs).ravel()
        right = (said == data.gold).ravel()
    else:
        top = probs.max(axis=1)
        conf, right = top, (said == data.gold)
    out["ece"] = round(float(calibration_error(conf.tolist(), right.tolist())), 6)
    return out


def _at_least_exact(figure: Figure, n: int) -> Figure:
    """An accuracy's interval at least as wide as the exact (Clopper-Pearson) one: the bootstrap's
    is too narrow on a few dozen rows and empty at 0 or 1 (40 of 40 right: [1, 1], where the head
    then answered 0.92 of fresh rows)."""
    low, high = bounds(round(figure.value * n), n, 1 - (1 - LEVEL) / 2)
    return Figure(figure.value, min(figure.low, low), max(figure.high, high))


def paired_gain(data: Labelled, head: np.ndarray, prompt: np.ndarray, seed: int) -> Figure:
    """The head's accuracy minus the prompt's on the same resamples (98%: a 1% chance of calling
    a winner where there is none)."""
    point = float(_scores(data, head, np.ones((1, data.n)))["accuracy"][0]
                  - _scores(data, prompt, np.ones((1, data.n)))["accuracy"][0])
    diffs = [_scores(data, head, w)["accuracy"] - _scores(data, prompt, w)["accuracy"] for w in resamples(data.n, seed)]
    return interval(point, np.concatenate(diffs), GAIN_LEVEL)


def learning_curve(data: Labelled, splits: Sequence[tuple[np.ndarray, np.ndarray]], choice: Choice, seed: int
                   ) -> list[dict[str, Any]]:
    """Held-out accuracy of a readout fitted on n labelled items a class (n in CURVE, up to the
    largest class's count; a class with fewer gives what it has), with the final C and features."""
    rng = np.random.default_rng(seed + 2)
    largest = max(data.counts().values())
    out = []
    for n in CURVE:
        if n > largest:
            break
        right = 0
        for train, test in splits:
            picked = np.concatenate([rng.permutation(train[data.gold[train] == k])[:n] for k in np.unique(data.gold[train])])
            probs = fitted_probs(data, np.sort(picked), test, choice.features, [choice.C])[0]
            right += int((probs.argmax(axis=1) == data.gold[test]).sum())
        out.append({"per_class": n, "accuracy": round(right / data.n, 6)})
    return out
