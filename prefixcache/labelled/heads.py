"""Fitting readouts on labelled items' states, and judging them honestly against the prompt rule.
scikit-learn (the `fit` extra) is imported by the functions that fit; no torch here.

One question's labelled data (`Labelled`) holds, per item, the final hidden state at its answer
position(s), its options' prompt log-probabilities, its gold option(s) and what the prompt rule
decided. A readout is a standardised logistic regression (multinomial over the options, or one
binary per tag). Its regularisation C and whether it also reads the options' prompt
log-probabilities are chosen by an inner cross-validation on the items it is fitted on, by log-loss
(a proper score: it rewards calibrated probabilities as well as right answers). Every figure is
held out: in k-fold cross-validation each fold is predicted by a readout chosen and fitted on the
other folds, and the prompt rule is measured on the same items, paired, with bootstrap intervals
(tune/selection.py owns the folds and the intervals).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import UsageError
from ..task.features import Features
from ..task.head import Readout
from ..task.scoring_metrics import calibration_error
from .cutpoint import CONFIDENCE, Cut, Row, bounds, choose_cut, least_items, per_option_cuts, risk_coverage
from ..reports.resampling import GAIN_LEVEL, LEVEL, Figure, cv_splits, interval, resamples

C_GRID = (0.01, 0.1, 1.0)  # on standardised states: strong to mild regularisation (fitted in this order)
FEATURE_SETS = ("state", "state+logprobs")  # the final state alone, or with the options' log-probs
NOISE = 2.0  # standard errors by which a feature set that needs the options scored must win to be chosen
INNER_FOLDS = 3
CURVE = (1, 2, 4, 8, 16, 32)  # labelled items a class in the learning curve
ABSENT = -30.0  # the logit of an option no fitted item had: never answered
# Newton steps with conjugate gradients: on 141 items of 106 intents (a C path of three), 0.14 s
# where L-BFGS took 1.5 s (its iterations are many on nearly separable data); the same optimum.
SOLVER = "newton-cg"


@dataclass
class Labelled:
    """One question's labelled items. Multiclass: `gold` [N] option index, `prompt` [N, K] the
    prompt rule's distribution, `said` [N] its answer (-1: abstained). Binary (tags): `gold`
    [N, K] bool, `prompt` [N, K] P(on), `said` [N, K] bool."""

    qid: str
    options: tuple[str, ...]
    binary: bool
    states: dict[str, np.ndarray]  # per view (task/features.py): [N, U, H]
    logprobs: np.ndarray  # [N, K] (NaN where the options were not scored)
    gold: np.ndarray
    prompt: np.ndarray
    said: np.ndarray
    threshold: float | None = None  # multiclass: the spec's, below which an answer abstains (-1)
    prompted: np.ndarray | None = None  # [N] bool: the items whose options were scored (None: all)
    groups: np.ndarray | None = None  # [N] the digest of each item's text: copies share a fold (None: all distinct)
    notes: tuple[str, ...] = ()  # what the reading of the items found to say (near-copies)
    ids: tuple[str, ...] = ()  # each item's id, as text (to name items in notes)
    texts: tuple[str, ...] = ()  # each item's text as the template reads it (for the TF-IDF baseline)
    picked: np.ndarray | None = None  # [N] bool: chosen by `suggest` (not at random); None: all at random

    def subset(self, idx: np.ndarray) -> "Labelled":
        """The items `idx` alone."""
        return replace(self, states={v: a[idx] for v, a in self.states.items()}, logprobs=self.logprobs[idx],
                       ids=tuple(self.ids[i] for i in idx) if self.ids else (),
                       texts=tuple(self.texts[i] for i in idx) if self.texts else (),
                       picked=None if self.picked is None else self.picked[idx],
                       gold=self.gold[idx], prompt=self.prompt[idx], said=self.said[idx], prompted=None,
                       groups=None if self.groups is None else self.groups[idx])

    @property
    def prompt_items(self) -> np.ndarray:
        """The items the prompt alone is measured on (those whose options were scored)."""
        return np.arange(self.n) if self.prompted is None else np.flatnonzero(self.prompted)

    @property
    def n(self) -> int:
        return len(self.gold)

    def strata(self) -> list[str]:
        return ["|".join(map(str, np.flatnonzero(g))) for g in self.gold] if self.binary else [str(g) for g in self.gold]

    def counts(self) -> dict[str, int]:
        """Labelled items per option (binary: items where it is on)."""
        if self.binary:
            return {o: int(self.gold[:, k].sum()) for k, o in enumerate(self.options)}
        return {o: int((self.gold == k).sum()) for k, o in enumerate(self.options)}


@dataclass(frozen=True)
class Choice:
    """What the inner cross-validation chose."""

    C: float
    features: str


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
                **({"tfidf_baseline": js(self.baseline)} if self.baseline else {}),
                "verdict": self.verdict, "verdict_words": self.verdict_words, "chosen": {"C": self.choice.C, "features": self.choice.features},
                "labelled_per_option": self.counts, "learning_curve": self.curve,
                **({"thresholds": dict(zip(self.counts, self.thresholds))} if self.thresholds else {}),
                **({"cut": self._cut_json()} if self.cut else {}),
                **({"since_last_fit": self.since.to_json()} if self.since else {}),
                **({"risk_coverage": [r.to_json() for r in self.coverage]} if self.coverage else {}),
                "notes": self.notes}

    def _cut_json(self) -> dict[str, Any]:
        out = self.cut.to_json()
        if "per_option" in out:  # by option name
            names = list(self.counts)
            out["per_option"] = {names[int(k)]: v for k, v in out["per_option"].items()}
        return out


# -- the design matrix and one readout ---------------------------------------------------------
def design(data: Labelled, features: str, unit: int | None = None) -> np.ndarray:
    """The features a readout reads: its views side by side, [N, V * H] (+ [N, K] log-probs);
    binary: of tag `unit`, [N, V * H] (+1)."""
    f = Features.parse(features)
    u = unit if data.binary else 0
    x = f.joined({v: data.states[v][:, u, :] for v in f.views})
    if not f.logprobs:
        return x
    return np.concatenate([x, data.logprobs[:, u:u + 1] if data.binary else data.logprobs], axis=1)


def _standardised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    return mean, np.where(scale > 1e-6, scale, 1.0)


def row_space(z: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Standardised features [N, D] in the span of their rows, [N, r] and the basis [r, D] (None:
    no wider than they are, kept as they are). With more features than items (a wide state, few
    labels), an L2-penalised logistic regression's weights lie in that span (a part outside it
    changes no prediction and only adds to the penalty), so fitting in it gives the same readout
    (weights = basis.T @ w) at a fraction of the cost."""
    n, d = z.shape
    if d <= n:
        return z, None
    u, s, vt = np.linalg.svd(z, full_matrices=False)  # z = u diag(s) vt: [N, N], [N], [N, D]
    r = int((s > s[0] * 1e-10).sum()) if len(s) and s[0] > 0 else 0
    if r == 0:
        return z[:, :0], np.zeros((0, d))
    return u[:, :r] * s[:r], vt[:r]


def fit_multiclass(x: np.ndarray, y: np.ndarray, k: int, cs: Sequence[float]) -> list[tuple[np.ndarray, ...]]:
    """Standardised multinomial logistic regressions over `k` options, one per C in `cs` (in
    order, each started from the one before: the regularisation path costs little more than its
    first fit): (mean [D], scale [D], coef [K, D], intercept [K]). An option absent from `y` gets
    the logit ABSENT (never answered)."""
    from sklearn.linear_model import LogisticRegression

    mean, scale = _standardised(x)
    z, basis = row_space((x - mean) / scale)
    present = np.unique(y)
    out = []
    model = LogisticRegression(max_iter=500, warm_start=True, solver=SOLVER)
    for c in cs:
        coef, intercept = np.zeros((k, z.shape[1])), np.full(k, ABSENT)
        if len(present) == 1 or z.shape[1] == 0:
            intercept[present] = 0.0 if len(present) == 1 else np.log(np.bincount(y)[present] / len(y))
            out.append((mean, scale, coef if basis is None else coef @ basis, intercept))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence warnings: the result is used as it is, and judged held out
            model.set_params(C=c).fit(z, y)
        if len(present) == 2:  # one row, for the second class: split it so that softmax gives the same
            coef[present[0]], coef[present[1]] = -model.coef_[0] / 2, model.coef_[0] / 2
            intercept[present[0]], intercept[present[1]] = -model.intercept_[0] / 2, model.intercept_[0] / 2
        else:
            coef[present], intercept[present] = model.coef_, model.intercept_
        out.append((mean, scale, coef if basis is None else coef @ basis, intercept))  # [K, D]
    return out


def fit_binary(x: np.ndarray, y: np.ndarray, cs: Sequence[float]) -> list[tuple[np.ndarray, ...]]:
    """Standardised binary logistic regressions, one per C in `cs` (warm-started along them):
    (mean [D], scale [D], coef [D], intercept); a tag always on or always off in `y` gets a
    constant near-certain answer."""
    from sklearn.linear_model import LogisticRegression

    mean, scale = _standardised(x)
    if y.all() or not y.any():
        return [(mean, scale, np.zeros(x.shape[1]), np.float64(-ABSENT if y.all() else ABSENT))] * len(cs)
    (z, basis), out = row_space((x - mean) / scale), []
    if z.shape[1] == 0:  # every item the same: the rate alone
        return [(mean, scale, np.zeros(x.shape[1]), np.float64(np.log(y.mean() / (1 - y.mean()))))] * len(cs)
    model = LogisticRegression(max_iter=500, warm_start=True, solver=SOLVER)
    for c in cs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.set_params(C=c).fit(z, y)
        coef = model.coef_[0] if basis is None else model.coef_[0] @ basis  # [D]
        out.append((mean, scale, coef.copy(), np.float64(model.intercept_[0])))
    return out


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=1, keepdims=True)


def fitted_probs(data: Labelled, train: np.ndarray, test: np.ndarray, features: str, cs: Sequence[float]
                 ) -> list[np.ndarray]:
    """Probabilities for the `test` items from readouts fitted on the `train` items, one [n, K]
    array per C in `cs`."""
    k = len(data.options)
    if data.binary:
        out = [np.empty((len(test), k)) for _ in cs]
        for u in range(k):
            x = design(data, features, u)
            for probs, (mean, scale, coef, b) in zip(out, fit_binary(x[train], data.gold[train, u], cs)):
                probs[:, u] = 1 / (1 + np.exp(-np.clip(((x[test] - mean) / scale) @ coef + b, -700, 700)))
        return out
    x = design(data, features)
    return [softmax_rows(((x[test] - mean) / scale) @ coef.T + b)
            for mean, scale, coef, b in fit_multiclass(x[train], data.gold[train], k, cs)]


def readout(data: Labelled, choice: Choice) -> Readout:
    """The readout fitted on every item, as a head file stores it."""
    k = len(data.options)
    if data.binary:
        parts = [fit_binary(design(data, choice.features, u), data.gold[:, u], [choice.C])[0] for u in range(k)]
        mean, scale = np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
        coef, intercept = np.stack([p[2] for p in parts]), np.array([float(p[3]) for p in parts])
    else:
        m, s, coef, intercept = fit_multiclass(design(data, choice.features), data.gold, k, [choice.C])[0]
        mean, scale = m[None], s[None]
    return Readout(data.qid, data.options, data.binary, choice.features, mean, scale, coef, intercept)


# -- choosing C and the features -----------------------------------------------------------------
def item_losses(data: Labelled, idx: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Each item's negative log-likelihood of its gold answer (binary: summed over tags), [n]."""
    p = np.clip(probs, 1e-12, 1 - 1e-12)
    if data.binary:
        g = data.gold[idx]
        return -(g * np.log(p) + (~g) * np.log(1 - p)).sum(axis=1)
    return -np.log(p[np.arange(len(idx)), data.gold[idx]])


def log_loss(data: Labelled, idx: np.ndarray, probs: np.ndarray) -> float:
    """Mean negative log-likelihood of the gold answers (binary: summed over tags)."""
    return float(item_losses(data, idx, probs).mean())


def choose(data: Labelled, items: np.ndarray, seed: int, feature_sets: Sequence[str] = FEATURE_SETS) -> Choice:
    """The (C, features) of least held-out log-loss in an inner cross-validation over `items`
    (features among `feature_sets`). A feature set that needs the options scored (they cost a
    pass over every option of every item at run time) is chosen only when it beats the best one
    that does not beyond noise: its per-item loss lower by more than NOISE standard errors."""
    groups = None if data.groups is None else [data.groups[i] for i in items]
    folds = min(INNER_FOLDS, len(items) if groups is None else len(set(groups)))
    splits = cv_splits([data.strata()[i] for i in items], folds, seed, groups)
    losses: dict[tuple[str, float], np.ndarray] = {}
    where = {k: n for n, k in enumerate(items)}
    for features in feature_sets:
        per = np.zeros((len(C_GRID), len(items)))
        for train, test in splits:
            at = [where[k] for k in items[test]]
            for n, probs in enumerate(fitted_probs(data, items[train], items[test], features, C_GRID)):
                per[n, at] = item_losses(data, items[test], probs)
        for c, row in zip(C_GRID, per):
            losses[(features, c)] = row
    cheap = {k: v for k, v in losses.items() if not Features.parse(k[0]).logprobs} or losses
    best = min(cheap, key=lambda k: float(cheap[k].mean()))
    costly = {k: v for k, v in losses.items() if k not in cheap}
    if costly:
        other = min(costly, key=lambda k: float(costly[k].mean()))
        d = losses[best] - losses[other]  # > 0 where the costly set is better
        if len(d) > 1 and d.mean() > NOISE * d.std(ddof=1) / np.sqrt(len(d)):
            best = other
    return Choice(best[1], best[0])


# -- the held-out comparison -----------------------------------------------------------------------
def judge(data: Labelled, folds: int, seed: int, step: Callable[[int, int], None] = lambda done, total: None,
          asked: Asked | None = None, feature_sets: Sequence[str] = FEATURE_SETS,
          before: np.ndarray | None = None) -> tuple[Judged, Readout]:
    """Cross-validate the head beside the prompt rule on the same folds; then the readout fitted
    on every item (with the C and features chosen on every item). `asked`: a cut-point to choose
    on the held-out probabilities (a question of one answer; tags have their thresholds).
    `before` [N] bool: the items the last fit had; the gain of the new ones is measured on the same
    folds (`Judged.since`)."""
    notes = [*data.notes, *_check_counts(data, folds)]
    folds = _fold_copies_together(data, folds, notes)
    splits = cv_splits(data.strata(), folds, seed, data.groups)
    probs = np.empty(data.prompt.shape)
    earlier = np.empty(data.prompt.shape) if before is not None and 0 < before.sum() < data.n else None
    everything = np.arange(data.n)
    for f, (train, test) in enumerate(splits):
        step(f, folds + 1)
        chosen = choose(data, train, seed, feature_sets)
        probs[test] = fitted_probs(data, train, test, chosen.features, [chosen.C])[0]
        if earlier is not None:  # the same fold's readout fitted on the items the last fit had alone
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
                    notes=notes, thresholds=thresholds, prompt_items=len(ev.prompt_items), texts=len(one))
    if earlier is not None:
        earlier = earlier[one]
        then = earlier >= np.asarray(thresholds) if data.binary else answered(earlier, data.threshold)
        judged.since = Since(int(before.sum()), figures(ev, then, earlier, seed)["accuracy"],
                             paired_gain(ev, head_said, then, seed))
    final = None
    if not data.binary:
        _one_answer(judged, ev, probs, asked if asked is not None and asked.target is None else None)
        judged.curve = learning_curve(data, splits, choice, seed)
        if data.texts:
            base = tfidf_baseline(data, splits)[one]
            judged.baseline = figures(ev, answered(base, data.threshold), base, seed)
        if asked is not None and asked.target is not None:
            final = _certified(judged, data, one, asked, seed, feature_sets)
    return judged, final or readout(data, choice)


def tfidf_baseline(data: Labelled, splits: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Held-out probabilities [N, K] of TF-IDF (words and word pairs, sublinear) + logistic
    regression on the items' texts, fold by fold: what a model-free classifier answers on the same
    folds, beside the head."""
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
        fitted = LogisticRegression(C=10.0, max_iter=2000).fit(vectors.fit_transform(texts[train]), data.gold[train])
        probs[np.ix_(test, fitted.classes_)] = fitted.predict_proba(vectors.transform(texts[test]))
    return probs


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
        judged.notes.append(_suspects_note(judged.suspects))
    top, best = probs.max(axis=1), probs.argmax(axis=1)
    if asked is not None:
        judged.cut = per_option_cuts(choose_cut(top, best == ev.gold, asked.target, asked.coverage, asked.confidence),
                                     top, best, best == ev.gold)
    judged.coverage = judged.cut.table if judged.cut else risk_coverage(top, best == ev.gold)


SUSPECTS_SHOWN = 5
CONFIDENT = 0.5  # a suspect's other answer is at least this probable (a weak head flags nothing it is unsure of)


def likely_errors(data: Labelled, probs: np.ndarray) -> list[dict[str, Any]]:
    """Labelled items the held-out head confidently answers otherwise (confident learning's
    idea): an item labelled i is suspect when another option j has a held-out probability at
    least j's own threshold (the mean held-out probability of j over the items labelled j), at
    least CONFIDENT, and above that of i. Most confident first, as {"id", "gold", "read_as", "probability"}."""
    k = probs.shape[1]
    thresholds = np.array([probs[data.gold == j, j].mean() if (data.gold == j).any() else 1.0 for j in range(k)])
    out = []
    for i in range(data.n):
        g = data.gold[i]
        over = [j for j in range(k)
                if j != g and probs[i, j] >= max(thresholds[j], CONFIDENT) and probs[i, j] > probs[i, g]]
        if over:
            j = max(over, key=lambda o: probs[i, o])
            out.append({"id": data.ids[i] if data.ids else str(i), "gold": data.options[g],
                        "read_as": data.options[j], "probability": round(float(probs[i, j]), 4)})
    return sorted(out, key=lambda s: -s["probability"])


def _suspects_note(suspects: list[dict[str, Any]]) -> str:
    shown = "; ".join(f"{s['id']!r} labelled {s['gold']!r}, read as {s['read_as']!r} ({s['probability']:.2f})"
                      for s in suspects[:SUSPECTS_SHOWN])
    more = f" and {len(suspects) - SUSPECTS_SHOWN} more (the JSON's likely_errors)" if len(suspects) > SUSPECTS_SHOWN else ""
    return (f"{len(suspects)} labelled item{'s' if len(suspects) != 1 else ''} the held-out head confidently answers "
            f"otherwise, likely label errors to check: {shown}{more}")


MIN_RANDOM = 10  # rows drawn at random from which the figures stand on them alone


def representative(data: Labelled, rows: np.ndarray, notes: list[str]) -> np.ndarray:
    """Of `rows`, those the figures and the cut stand on: the rows drawn at random when some were
    picked by `suggest` (the least sure: estimates on them describe them, not the items the head
    will answer) and at least MIN_RANDOM were drawn at random; said in a note either way."""
    if data.picked is None or not data.picked[rows].any():
        return rows
    drawn = rows[~data.picked[rows]]
    picked = len(rows) - len(drawn)
    if len(drawn) >= MIN_RANDOM:
        notes.append(f"every held-out figure and cut stands on the {len(drawn)} rows drawn at random; the {picked} "
                     f"rows suggest picked (picked_by) train the head but are left out of them, since they are the "
                     f"hardest by construction")
        return drawn
    notes.append(f"{picked} of the {len(rows)} rows were picked by suggest (the hardest by construction) and only "
                 f"{len(drawn)} drawn at random: the figures stand on all of them and describe those rows, not the "
                 f"items the head will answer; label rows of `suggest --random` (at least {MIN_RANDOM})")
    return rows


def once_a_text(data: Labelled) -> np.ndarray:
    """One item of each text, in order (every item when no two share one): the first whose
    options were scored, else the first."""
    if data.groups is None:
        return np.arange(data.n)
    scored = np.ones(data.n, dtype=bool) if data.prompted is None else data.prompted
    order = np.lexsort((~scored, data.groups))  # by text, the scored first (a stable sort: then in order)
    _, first = np.unique(data.groups[order], return_index=True)
    return np.sort(order[first])


def _fold_copies_together(data: Labelled, folds: int, notes: list[str]) -> int:
    """The folds to use when some items are copies of another's text (they share a fold), noted."""
    if data.groups is None or len(set(data.groups)) == data.n:
        return folds
    copies = data.n - len(set(data.groups))
    notes.append(f"{copies} labelled item{'s are copies' if copies != 1 else ' is a copy'} of another's text: each "
                 f"kept in one fold with it, so that no item is judged by a head fitted on its copy, and every "
                 f"held-out figure and cut counts each text once")
    return min(folds, len(set(data.groups)))


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


def _check_counts(data: Labelled, folds: int) -> list[str]:
    """Refuse what cannot be fitted; say, in a line each, what will be rough."""
    counts = data.counts()
    if data.binary:
        if not any(counts.values()):
            raise UsageError(f"{data.qid}: no labelled item has any label on: a head needs items of each kind")
        return [f"label {o!r} is on for {n} of {data.n} labelled items: its head answers it "
                f"{'never' if n == 0 else 'always' if n == data.n else 'from very little'}"
                for o, n in counts.items() if n < 2 or n > data.n - 2]
    present = [o for o, n in counts.items() if n]
    if len(present) < 2:
        raise UsageError(f"{data.qid}: every labelled item has the gold {present[0]!r}: a head needs items of two "
                         f"options or more")
    notes = [f"{', '.join(repr(o) for o, n in counts.items() if not n)}: no labelled item, the head never answers "
             f"{'it' if sum(not n for n in counts.values()) == 1 else 'them'}"] if len(present) < len(counts) else []
    rare = [f"{o!r} ({n})" for o, n in counts.items() if 0 < n < folds]
    if rare:
        notes.append(f"fewer labelled items than folds ({folds}) for {', '.join(rare[:5])}"
                     f"{' and more' if len(rare) > 5 else ''}: those folds are fitted without them, so the "
                     f"held-out figures understate the head")
    return notes


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


def figures(data: Labelled, said: np.ndarray, probs: np.ndarray, seed: int) -> dict[str, Figure | float | None]:
    """Held-out accuracy and macro-F1 with their bootstrap intervals, and the calibration error."""
    point = {k: float(v[0]) for k, v in _scores(data, said, np.ones((1, data.n))).items()}
    draws: dict[str, list] = {"accuracy": [], "macro_f1": []}
    for w in resamples(data.n, seed):
        for k, v in _scores(data, said, w).items():
            draws[k].append(v)
    out: dict[str, Figure | float | None] = {k: interval(point[k], np.concatenate(draws[k]), LEVEL) for k in point}
    out["accuracy"] = _at_least_exact(out["accuracy"], data.n)
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
