"""`fit`'s readouts: the design matrix a readout reads (its views, and the options' prompt
log-probabilities where chosen), standardised logistic regressions fitted on it (multinomial over
the options, or one binary per tag; scikit-learn, the `fit` extra, imported where they fit), and
the inner cross-validation that chooses C and the features by log-loss. No torch here.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from ..reports.resampling import cv_splits
from ..task.features import Features
from ..task.familiar import summarise
from ..task.head import Readout
from .data import Choice, Labelled

C_GRID = (0.01, 0.1, 1.0)  # on standardised states: strong to mild regularisation (fitted in this order)
FEATURE_SETS = ("state", "state+logprobs")  # the final state alone, or with the options' log-probs
NOISE = 2.0  # standard errors by which a feature set that needs the options scored must win to be chosen
INNER_FOLDS = 3
ABSENT = -30.0  # the logit of an option no fitted item had: never answered
# Newton steps with conjugate gradients: on 141 items of 106 intents (a C path of three), 0.14 s
# where L-BFGS took 1.5 s (its iterations are many on nearly separable data); the same optimum.
SOLVER = "newton-cg"


# -- the design matrix and one readout ---------------------------------------------------------
def design(data: Labelled, features: str, unit: int | None = None) -> np.ndarray:
    """The features a readout reads: its views side by side, [N, V * H] (+ [N, K] log-probs);
    binary: of tag `unit`, [N, V * H] (+1)."""
    f = Features.parse(features)
    u = unit if data.binary and unit is not None else 0
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


Fitted = tuple[np.ndarray, np.ndarray, np.ndarray, Any]  # a readout's mean, scale, coef and intercept


def fit_multiclass(x: np.ndarray, y: np.ndarray, k: int, cs: Sequence[float]) -> list[Fitted]:
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


def fit_binary(x: np.ndarray, y: np.ndarray, cs: Sequence[float]) -> list[Fitted]:
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
    f = Features.parse(choice.features)
    familiar = summarise(f.joined({v: data.states[v][:, 0, :] for v in f.views}))  # no text: the states in brief
    return Readout(data.qid, data.options, data.binary, choice.features, mean, scale, coef, intercept,
                   familiar=familiar)


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
