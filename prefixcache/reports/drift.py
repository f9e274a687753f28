"""A run compared with a reference run on other items: whether its answers are distributed as the
reference's were, without labels (`prefixcache drift`).

Where `diff` joins two runs on the same items, drift asks of two runs on different items (last
week's and tonight's) whether the same process could have produced both: per question its answers'
shares (a G-test of homogeneity, and the population stability index as the size of a change), the
answers' confidence and, for a label set, its margin (two-sample Kolmogorov-Smirnov), and the
shares of abstained and failed items (Fisher's exact test). Each p-value says how often a
difference at least this large arises between two samples of these sizes from one process; the
alarm fires when any is below `alpha` divided by the number of tests (Bonferroni: `alpha` bounds
the chance of any false alarm in the whole comparison). What the fingerprints say changed (the
model, the spec, the engine, the precision, the head) is said as fact, beside the tests.

Example:
    drift = compare_runs("runs/monday.jsonl", "runs/tuesday.jsonl", alpha=0.01)
    print(drift.line())          # one line for a log
    if drift.alarm: ...
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..data.output import fingerprint_of, read_records
from ..data.records import Record, is_error
from ..errors import InputError
from ..task.familiar import beyond
from ..task.questions import answer_word
from .diff import ABSTAINED
from .markdown import cell, code

ALPHA = 0.01  # the chance of any false alarm in one comparison
# What a fingerprint names that changes what the answers are, and in words.
IDENTITY = (("model", "the model"), ("spec", "the spec"), ("head", "the fitted head"), ("engine", "the engine"),
            ("engine_version", "the engine's version"), ("dtype", "the precision"), ("exact", "--exact"),
            ("device", "the device"))


@dataclass(frozen=True)
class Test:
    """One comparison: what is compared, its statistic and two-sided p-value, the size of the
    change where it has one (PSI for shares), and the figures in words."""

    name: str
    statistic: float
    p: float
    words: str
    psi: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "statistic": round(self.statistic, 6), "p": self.p, "words": self.words,
                **({"psi": round(self.psi, 6)} if self.psi is not None else {})}


@dataclass(frozen=True)
class Estimate:
    """A run's accuracy on its answered items, estimated without labels from its answers'
    probabilities (each answered item is right with the probability of its answer, if those are
    calibrated): the estimate, its standard error, the items answered and, where the records carry
    gold values, the accuracy they realise."""

    value: float
    error: float
    answered: int
    realised: float | None = None
    held_out: bool = False  # from a head's held-out reliability (p_correct), not the answers' own probabilities

    def words(self) -> str:
        real = f", realised {self.realised:.3f}" if self.realised is not None else ""
        source = "held-out reliability" if self.held_out else "the answers' probabilities"
        return f"{self.value:.3f} ± {self.error:.3f} ({source}{real})"

    def to_json(self) -> dict[str, Any]:
        return {"value": round(self.value, 6), "error": round(self.error, 6), "answered": self.answered,
                "from": "p_correct" if self.held_out else "prob",
                **({"realised": round(self.realised, 6)} if self.realised is not None else {})}


def estimate_accuracy(records: Sequence[Record]) -> Estimate | None:
    """The answered items' expected accuracy from a label set's (or a choice's) records: the mean
    chance of each answer being right, with the standard error of a sum of independent calls. That
    chance is `p_correct` where a fitted head measured it on held-out rows (how often its answers
    that sure were right), else the answer's own probability (None for records of tags or typed
    questions, or none answered)."""
    answered = [r for r in records if not is_error(r) and r.get("label") is not None and isinstance(r.get("prob"), float)]
    if not answered:
        return None
    held_out = all(isinstance(r.get("p_correct"), float) for r in answered)
    probs = [float(r["p_correct"] if held_out else r["prob"]) for r in answered]
    n = len(probs)
    graded = [r["correct"] for r in answered if isinstance(r.get("correct"), bool)]
    return Estimate(sum(probs) / n, math.sqrt(sum(p * (1 - p) for p in probs)) / n, n,
                    sum(graded) / len(graded) if len(graded) == n else None, held_out)


@dataclass
class Drift:
    """The comparison of `current` with `reference`: the items on each side, the tests, what the
    fingerprints say changed, and the threshold the alarm is held to."""

    reference: str
    current: str
    n_reference: int
    n_current: int
    tests: list[Test] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    alpha: float = ALPHA
    estimates: tuple[Estimate | None, Estimate | None] = (None, None)  # the reference's and the current run's

    @property
    def cut(self) -> float:
        """The p-value below which one test raises the alarm (`alpha` shared among the tests)."""
        return self.alpha / max(len(self.tests), 1)

    @property
    def fired(self) -> list[Test]:
        return [t for t in self.tests if t.p < self.cut]

    @property
    def alarm(self) -> bool:
        return bool(self.fired)

    def gate_failures(self, on_drift: bool = False, min_estimated: float | None = None) -> list[str]:
        """What the gates asked for found: the alarm (`on_drift`), and the current run's estimated
        accuracy below `min_estimated` (or none to estimate: a spec of tags or typed questions)."""
        out = [f"the answers drifted ({len(self.fired)} of {len(self.tests)} tests below p={self.cut:.2g})"
               ] if on_drift and self.alarm else []
        if min_estimated is not None:
            estimate = self.estimates[1]
            if estimate is None:
                out.append("--min-estimated-accuracy: the current run's records give no answer probabilities to "
                           "estimate from (a label set or multiple choice gives them)")
            elif estimate.value < min_estimated:
                out.append(f"the estimated accuracy {estimate.value:.4f} is below --min-estimated-accuracy "
                           f"{min_estimated}")
        return out

    def line(self) -> str:
        """The verdict in one line, for a log."""
        sizes = f"{self.n_current} items against {self.n_reference}"
        if self.fired:
            head = "DRIFT: " + "; ".join(f"{t.name} (p={t.p:.2g}: {t.words})" for t in self.fired)
        else:
            least = min(self.tests, key=lambda t: t.p, default=None)
            head = "no drift" + (f" (least p={least.p:.2g}, {least.name}; alarm below {self.cut:.2g})" if least else "")
        changed = f"; changed: {', '.join(self.changed)}" if self.changed else ""
        before, after = self.estimates
        estimated = ""
        if before is not None and after is not None:
            apart = before.held_out != after.held_out  # estimated from other sources: said, not hidden
            source = {True: " from held-out reliability", False: " from the answers' probabilities"}
            estimated = (f"; estimated accuracy {after.value:.3f}{source[after.held_out] if apart else ''} "
                         f"(reference {before.value:.3f}{source[before.held_out] if apart else ''})")
        return f"drift: {head}; {sizes}{estimated}{changed}"

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "current": self.current, "items": [self.n_reference, self.n_current],
                "alpha": self.alpha, "cut": self.cut, "alarm": self.alarm, "changed": self.changed,
                "estimated_accuracy": [None if e is None else e.to_json() for e in self.estimates],
                "tests": [t.to_json() for t in self.tests]}

    def to_markdown(self) -> str:
        lines = [f"### prefixcache drift: {'DRIFT' if self.alarm else 'no drift'}", "",
                 f"{code(self.current)} ({self.n_current} items) against {code(self.reference)} "
                 f"({self.n_reference} items); alarm below p={self.cut:.2g} (alpha {self.alpha} over "
                 f"{len(self.tests)} tests)", ""]
        lines += [f"- changed: {', '.join(self.changed)}", ""] if self.changed else []
        before, after = self.estimates
        if before is not None and after is not None:
            lines += [f"- estimated accuracy of the answered items: {after.words()} "
                      f"(reference {before.words()})", ""]
        lines += ["| test | p | PSI | what |", "|---|---|---|---|"]
        lines += [f"| {cell(t.name)}{' ⚠' if t in self.fired else ''} | {t.p:.3g} | "
                  f"{'-' if t.psi is None else f'{t.psi:.3f}'} | {cell(t.words)} |" for t in self.tests]
        return "\n".join(lines) + "\n"


def compare_runs(reference: str, current: str, alpha: float = ALPHA) -> Drift:
    """`current`'s records against `reference`'s (two outputs of `run`, on other items)."""
    if not 0 < alpha < 1:
        raise InputError(f"alpha must be between 0 and 1, got {alpha}")
    before, after = _records(reference), _records(current)
    drift = Drift(reference, current, len(before), len(after), alpha=alpha,
                  changed=fingerprint_changes(fingerprint_of(reference), fingerprint_of(current)))
    drift.tests = runs_tests(before, after)
    drift.estimates = (estimate_accuracy(before), estimate_accuracy(after))
    return drift


def _records(path: str) -> list[Record]:
    records = read_records(path, strict=True).records
    if not records:
        raise InputError(f"{path}: holds no records to compare")
    return records


def runs_tests(before: Sequence[Record], after: Sequence[Record]) -> list[Test]:
    """Every test of two runs' records: per question its answers' shares and confidence (a label
    set's margin too), then the failed items' share."""
    a, b = [r for r in before if not is_error(r)], [r for r in after if not is_error(r)]
    tests = []
    for name, view in answer_views(a + b):
        left, right = [view(r) for r in a], [view(r) for r in b]
        shares = shares_test(name, [v[0] for v in left], [v[0] for v in right])
        tests += [shares] if shares is not None else []
        tests.append(ks_test(f"{name} confidence", [v[1] for v in left if v[1] is not None],
                             [v[1] for v in right if v[1] is not None]))
        if any(v[2] is not None for v in left + right):
            tests.append(ks_test(f"{name} margin", [v[2] for v in left if v[2] is not None],
                                 [v[2] for v in right if v[2] is not None]))
    tests.append(rate_test("failed items", sum(map(is_error, before)), len(before), sum(map(is_error, after)),
                           len(after)))
    seen = [[beyond(r["novelty"]) for r in side if "novelty" in r] for side in (a, b)]
    if all(seen):  # a head that keeps its fitted rows in brief: the items beyond them
        tests.append(rate_test("items unlike the head's fitted rows", sum(seen[0]), len(seen[0]), sum(seen[1]),
                               len(seen[1])))
    return [t for t in tests if not math.isnan(t.p)]


# -- what each record answers ------------------------------------------------------------------------
View = Any  # a record -> (its answer in a word, its confidence, its margin or None)


def answer_views(records: Sequence[Record]) -> list[tuple[str, View]]:
    """Per question the records answer, how a record's answer reads: a label set or choice (one
    word a record), a multi-label set (each label on or off), or a pack's typed questions."""
    first = records[0] if records else {}
    if "answers" in first:
        return [(f"question {qid}", _question_view(qid)) for qid in first["answers"]]
    if "labels" in first:
        return [(f"label {name}", _tag_view(name)) for name in first.get("probs", {})]
    return [("labels", _label_view)]


def _label_view(record: Mapping[str, Any]) -> tuple[str, float | None, float | None]:
    probs = record.get("probs")
    values = list(probs.values()) if isinstance(probs, dict) else list(probs or [])
    label = record.get("label")
    return (ABSTAINED if label is None else str(label), max(values) if values else None, record.get("margin"))


def _tag_view(name: str) -> View:
    def view(record: Mapping[str, Any]) -> tuple[str, float | None, float | None]:
        p = record.get("probs", {}).get(name)
        return ("on" if name in record.get("labels", ()) else "off", None if p is None else max(p, 1 - p), None)
    return view


def _question_view(qid: str) -> View:
    def view(record: Mapping[str, Any]) -> tuple[str, float | None, float | None]:
        answer = record.get("answers", {}).get(qid)
        if not isinstance(answer, dict):
            return ("(none)", None, None)
        return (answer_word(answer), answer.get("confidence"), None)
    return view


def history(runs: Sequence[str], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Several runs' outputs, oldest first, each against the first (the reference): per run its
    items, its answers' shares and median confidence (the first question's), the comparison's
    verdict and least p-value, its estimated accuracy and its share of items unlike a head's
    fitted rows (None where its records say none)."""
    if len(runs) < 2:
        raise InputError("give two runs or more (the first is the reference)")
    loaded = [_records(path) for path in runs]
    reference = loaded[0]
    name, view = answer_views([r for r in reference if not is_error(r)])[0]
    out = []
    for path, records in zip(runs, loaded, strict=True):
        answered = [r for r in records if not is_error(r)]
        seen = [view(r) for r in answered]
        counts = Counter(word for word, _, _ in seen)
        confidence = sorted(c for _, c, _ in seen if c is not None)
        against = Drift(runs[0], path, len(reference), len(records), alpha=alpha,
                        tests=runs_tests(reference, records) if records is not reference else [])
        read = [beyond(r["novelty"]) for r in answered if "novelty" in r]
        estimate = estimate_accuracy(records)
        out.append({"run": path, "items": len(records), "question": name,
                    "shares": {k: n / len(seen) for k, n in counts.items()} if seen else {},
                    "confidence": confidence[len(confidence) // 2] if confidence else None,
                    "alarm": against.alarm, "least_p": min((t.p for t in against.tests), default=None),
                    "estimated_accuracy": None if estimate is None else estimate.value,
                    "beyond": sum(read) / len(read) if read else None})
    return out


# -- the tests -----------------------------------------------------------------------------------------
def shares_test(name: str, before: Sequence[str], after: Sequence[str]) -> Test | None:
    """The answers' shares on each side: a G-test of homogeneity of the 2 x K table (K answers
    seen on either side; none when only one answer was ever given) and the PSI between them."""
    left, right = Counter(before), Counter(after)
    keys = sorted(set(left) | set(right))
    n, m = len(before), len(after)
    if len(keys) < 2 or not n or not m:
        return None
    g = 0.0
    for k in keys:
        total = left[k] + right[k]
        for observed, size in ((left[k], n), (right[k], m)):
            expected = total * size / (n + m)
            g += 2 * observed * math.log(observed / expected) if observed else 0.0
    psi = sum((right[k] / m - left[k] / n) * math.log(((right[k] + 0.5) / (m + 0.5 * len(keys)))
                                                      / ((left[k] + 0.5) / (n + 0.5 * len(keys)))) for k in keys)
    moved = sorted(keys, key=lambda k: -abs(right[k] / m - left[k] / n))[:3]
    words = ", ".join(f"{k} {100 * left[k] / n:.0f}% -> {100 * right[k] / m:.0f}%" for k in moved)
    return Test(f"{name} shares", g, chi2_sf(g, len(keys) - 1), words, psi)


def ks_test(name: str, before: Sequence[float], after: Sequence[float]) -> Test:
    """Two-sample Kolmogorov-Smirnov: the largest gap between the two empirical distributions,
    and its asymptotic p-value (with Stephens' small-sample correction)."""
    n, m = len(before), len(after)
    if not n or not m:
        return Test(name, 0.0, math.nan, "no values on one side")
    left, right = sorted(before), sorted(after)
    d = max(abs(bisect.bisect_right(left, x) / n - bisect.bisect_right(right, x) / m) for x in left + right)
    en = math.sqrt(n * m / (n + m))
    p = kolmogorov_sf((en + 0.12 + 0.11 / en) * d)
    mid = (lambda xs: xs[len(xs) // 2])
    return Test(name, d, p, f"median {mid(left):.3f} -> {mid(right):.3f}, largest gap {d:.3f}")


def rate_test(name: str, k1: int, n1: int, k2: int, n2: int) -> Test:
    """A share of items on each side (`k` of `n`): Fisher's exact test, two-sided."""
    if not n1 or not n2:
        return Test(name, 0.0, math.nan, "no items on one side")
    return Test(name, k2 / n2 - k1 / n1, fisher_exact(k1, n1, k2, n2),
                f"{100 * k1 / n1:.1f}% -> {100 * k2 / n2:.1f}%")


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-squared with `df` degrees of freedom (the regularised upper incomplete
    gamma function Q(df/2, x/2), by its series or its continued fraction)."""
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    if z < a + 1:  # the series of P, then Q = 1 - P
        term = total = 1.0 / a
        for k in range(1, 10_000):
            term *= z / (a + k)
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)  # Lentz's continued fraction for Q
    h = d
    for k in range(1, 10_000):
        an = -k * (k - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return min(1.0, math.exp(-z + a * math.log(z) - math.lgamma(a)) * h)


def kolmogorov_sf(t: float) -> float:
    """P(K > t) for Kolmogorov's distribution (the limit of sqrt(n) times the KS statistic)."""
    if t < 0.2:
        return 1.0
    total = sum((-1) ** (k - 1) * math.exp(-2 * k * k * t * t) for k in range(1, 101))
    return min(1.0, max(0.0, 2 * total))


def fisher_exact(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided Fisher's exact test of k1/n1 against k2/n2: the hypergeometric probability of the
    tables with the same margins no more probable than this one."""
    total, hits = n1 + n2, k1 + k2

    def logp(k: int) -> float:  # k of the hits on the first side
        return (math.lgamma(hits + 1) - math.lgamma(k + 1) - math.lgamma(hits - k + 1)
                + math.lgamma(total - hits + 1) - math.lgamma(n1 - k + 1) - math.lgamma(total - hits - n1 + k + 1)
                - (math.lgamma(total + 1) - math.lgamma(n1 + 1) - math.lgamma(n2 + 1)))

    low, high = max(0, hits - n2), min(hits, n1)
    seen = logp(k1)
    return min(1.0, sum(math.exp(lp) for lp in map(logp, range(low, high + 1)) if lp <= seen + 1e-9))


# -- what the fingerprints say -------------------------------------------------------------------------
def fingerprint_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What the two runs' fingerprints name differently of what decides the answers, in words
    ("the model: a -> b"); a run without a fingerprint is said as such."""
    if not before and not after:
        return ["neither run has a fingerprint: what produced them is unknown"]
    if not before or not after:
        return [f"{'the reference' if not before else 'the current run'} has no fingerprint: what produced it is unknown"]
    out = []
    for key, words in IDENTITY:
        if before.get(key) != after.get(key):
            out.append(f"{words} ({_short(before.get(key))} -> {_short(after.get(key))})")
    return out


def _short(value: Any) -> str:
    text = "none" if value is None else str(value)
    return text if len(text) <= 24 else text[:12] + "…" + text[-8:]


def write_drift_reports(drift: Drift, md: Path | None, as_json: Path | None) -> None:
    """--md (appended, as CI step summaries are) and --json; neither may be one of the outputs."""
    from ..data.output import check_distinct, check_report
    from .evaluation import write_report_file

    check_distinct({"--md": md, "--json": as_json}, {"REFERENCE": drift.reference, "CURRENT": drift.current},
                   outputs=("REFERENCE", "CURRENT"))
    check_report(md, "--md")
    check_report(as_json, "--json")
    if md:
        write_report_file(Path(md), drift.to_markdown(), append=True)
    if as_json:
        write_report_file(Path(as_json), json.dumps(drift.to_json(), indent=2, ensure_ascii=False) + "\n")
