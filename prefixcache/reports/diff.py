"""What changed between two runs' outputs: joined by id, label flips, confidence shifts, and with
gold values an exact McNemar test of whether the accuracy difference is more than noise. No torch.

Example:
    cmp = compare(read_records("before.jsonl").records, read_records("after.jsonl").records)
    cmp.changed, cmp.accuracy_b - cmp.accuracy_a, cmp.p_value
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import InputError, OutputError, UsageError
from ..data.records import Record, input_fields, is_error, question_ids, question_view, record_id, repeated
from ..data.output import check_distinct, check_report, read_records
from .evaluation import write_report_file
from .markdown import cell, code

ERROR = "(error)"
ABSTAINED = "(abstained)"
NONE = "(none)"  # a multi-label item with no label on


@dataclass
class Change:
    id: str
    label_a: str
    label_b: str
    prob_a: float | None
    prob_b: float | None
    shift: float  # the probability of A's choice, in B minus in A
    kept: dict[str, Any]  # the input fields the records carry (from B, else A)


@dataclass
class Comparison:
    both: int
    only_a: list[str]
    only_b: list[str]
    labels_a: list[str]  # the label set of each run (empty for multiple choice)
    labels_b: list[str]
    flips: Counter  # (label in A, label in B) -> items
    changed: list[Change]
    shifts: list[Change]  # every joined item, largest |shift| first
    gold: bool = False  # both runs carry gold values (then the figures below are set)
    accuracy_a: float = 0.0
    accuracy_b: float = 0.0
    fixed: list[str] = field(default_factory=list)  # wrong in A, right in B
    broken: list[str] = field(default_factory=list)  # right in A, wrong in B
    p_value: float = 1.0
    per_label: dict[str, dict[str, Any]] = field(default_factory=dict)  # multi-label: each label's flips (and McNemar)

    @property
    def change_rate(self) -> float:
        return len(self.changed) / self.both if self.both else 0.0

    @property
    def same_labels(self) -> bool:
        return self.labels_a == self.labels_b

    def gate_failures(self, max_change: float | None = None, no_regression: bool = False) -> list[str]:
        """One line per CI gate missed: more items changed than `max_change` (a share), or, with
        `no_regression`, a lower accuracy in B."""
        if no_regression and not self.gold:
            raise UsageError("--fail-on-regression needs gold values in both outputs (run with --gold)")
        out = []
        if max_change is not None and self.change_rate > max_change:
            out.append(f"{self.change_rate:.1%} of the items changed label, more than --fail-on-change {max_change}")
        if no_regression and self.accuracy_b < self.accuracy_a:
            out.append(f"accuracy dropped from {self.accuracy_a:.4f} to {self.accuracy_b:.4f}")
        return out

    def to_json(self, top: int = 10) -> dict[str, Any]:
        """The figures; the changed items and the largest shifts are the first `top` of each, and
        `changed_items_listed` / `largest_shifts_listed` say how many are listed of how many."""
        data = {
            "items_in_both": self.both, "only_in_a": self.only_a, "only_in_b": self.only_b,
            "labels_a": self.labels_a, "labels_b": self.labels_b, "changed": len(self.changed),
            "change_rate": self.change_rate,
            "flips": [{"from": a, "to": b, "items": n} for (a, b), n in sorted(self.flips.items())],
            "changed_items": [vars(c) for c in self.changed[:top]],
            "largest_shifts": [vars(c) for c in self.shifts[:top]],
            "changed_items_listed": f"{min(top, len(self.changed))} of {len(self.changed)}",
            "largest_shifts_listed": f"{min(top, len(self.shifts))} of {len(self.shifts)}",
        }
        if self.gold:
            data.update(accuracy_a=self.accuracy_a, accuracy_b=self.accuracy_b,
                        accuracy_difference=self.accuracy_b - self.accuracy_a, fixed=self.fixed, broken=self.broken,
                        mcnemar_p=self.p_value)
        if self.per_label:
            data["per_label"] = self.per_label
        return data

    def to_markdown(self, name_a: str, name_b: str, top: int = 10) -> str:
        lines = [f"### prefixcache diff: {code(name_a)} → {code(name_b)}", "",
                 f"{self.both} items in both · {len(self.changed)} changed ({self.change_rate:.1%})"
                 + (f" · only in A: {len(self.only_a)}" if self.only_a else "")
                 + (f" · only in B: {len(self.only_b)}" if self.only_b else ""), ""]
        if not self.same_labels:
            lines += [f"The runs used different label sets: A {cell(self.labels_a)}, B {cell(self.labels_b)}; "
                      "probabilities are compared on the labels they share.", ""]
        if self.gold:
            lines += [f"accuracy **{self.accuracy_a:.3f} → {self.accuracy_b:.3f}** "
                      f"({self.accuracy_b - self.accuracy_a:+.3f}) · fixed {len(self.fixed)} · broken {len(self.broken)} · "
                      f"McNemar exact p = {self.p_value:.3g}", ""]
        if self.per_label:
            lines += self._per_label_markdown() + [""]
        if self.flips:
            lines += ["| from | to | items |", "|---|---|---|"]
            lines += [f"| {cell(a)} | {cell(b)} | {n} |" for (a, b), n in self.flips.most_common(top)]
            if len(self.flips) > top:
                lines.append(f"| … | {len(self.flips) - top} more pairs | |")
            lines += ["", "| id | A | B | p(A's label) A → B |", "|---|---|---|---|"]
            lines += [f"| {cell(c.id)} | {cell(c.label_a)} | {cell(c.label_b)} | {_p(c.prob_a)} → "
                      f"{_p(None if c.prob_a is None else c.prob_a + c.shift)} |"
                      for c in self.changed[:top]]
            if len(self.changed) > top:
                lines.append(f"| … | {len(self.changed) - top} more changed items (--top {top} listed) | | |")
        return "\n".join(lines) + "\n"


    def _per_label_markdown(self) -> list[str]:
        head = "| label | turned on | turned off |" + (" fixed | broken | McNemar p |" if self.gold else "")
        lines = [head, "|---" * (head.count("|") - 1) + "|"]
        for name, f in self.per_label.items():
            row = f"| {cell(name)} | {f['turned_on']} | {f['turned_off']} |"
            lines.append(row + (f" {f['fixed']} | {f['broken']} | {f['mcnemar_p']:.3g} |" if self.gold else ""))
        return lines


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def mcnemar_exact(broken: int, fixed: int) -> float:
    """Two-sided exact McNemar test: the binomial probability, under "no difference" (each
    discordant item as likely to go either way), of a split at least as uneven as this one."""
    n = broken + fixed
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(broken, fixed) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _label(record: Mapping[str, Any]) -> str:
    if is_error(record):
        return ERROR
    if "labels" in record:  # multi-label: the set of labels on
        return ", ".join(map(str, record["labels"])) or NONE
    return ABSTAINED if record.get("label") is None else str(record["label"])


def _labels(records: Sequence[Record]) -> list[str]:
    for record in records:
        if isinstance(record.get("probs"), dict):
            return list(record["probs"])
    return []


def _prob_of(record: Mapping[str, Any], label: str, index: Any) -> float | None:
    probs = record.get("probs")
    if isinstance(probs, dict):
        return probs.get(label)
    if isinstance(probs, list) and isinstance(index, int) and 0 <= index < len(probs):
        return probs[index]
    return None



def compare(a: Sequence[Record], b: Sequence[Record]) -> Comparison:
    """Join two runs' records by id and say what changed."""
    by_a, by_b = {record_id(r): r for r in a}, {record_id(r): r for r in b}
    common = [key for key in by_a if key in by_b]
    flips: Counter = Counter()
    changed, joined = [], []
    for key in common:
        ra, rb = by_a[key], by_b[key]
        la, lb = _label(ra), _label(rb)
        pa, pb = _prob_of(ra, la, ra.get("index")), _prob_of(rb, la, ra.get("index"))
        change = Change(key, la, lb, pa, _prob_of(rb, lb, rb.get("index")),
                        (pb - pa) if pa is not None and pb is not None else _tag_shift(ra, rb),
                        input_fields(rb) or input_fields(ra))
        joined.append(change)
        if la != lb:
            flips[(la, lb)] += 1
            changed.append(change)
    result = Comparison(len(common), [k for k in by_a if k not in by_b], [k for k in by_b if k not in by_a],
                        _labels(a), _labels(b), flips, changed, sorted(joined, key=lambda c: -abs(c.shift)))
    graded = [k for k in common if "gold" in by_a[k] or "gold" in by_b[k]]
    judged = [(k, _correct(by_a[k]), _correct(by_b[k])) for k in graded]
    pairs = [(k, a_right, b_right) for k, a_right, b_right in judged if a_right is not None and b_right is not None]
    if graded and len(pairs) == len(judged):
        _evaluate(result, pairs)
    tags = [name for name in result.labels_a if name in result.labels_b] if _tagged(a) and _tagged(b) else []
    result.per_label = {name: _label_flips(name, [(by_a[k], by_b[k]) for k in common], result.gold) for name in tags}
    return result


def _tagged(records: Sequence[Record]) -> bool:
    return any("labels" in r for r in records)


def _tag_shift(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """Multi-label: the largest change of any label's probability (signed); 0 for other records."""
    pa, pb = a.get("probs"), b.get("probs")
    if "labels" not in a or not isinstance(pa, dict) or not isinstance(pb, dict):
        return 0.0
    return max(((pb[k] - pa[k]) for k in pa if k in pb), key=abs, default=0.0)


def _label_flips(name: str, pairs: list[tuple[Record, Record]], gold: bool) -> dict[str, Any]:
    """One label of a multi-label task across two runs: items it turned on and off; with gold,
    items where its decision became right or wrong, and the exact McNemar p of that split."""
    def on(record: Record) -> bool | None:
        return None if is_error(record) else name in record["labels"]

    flips: dict[str, Any] = {"turned_on": 0, "turned_off": 0}
    fixed = broken = 0
    for ra, rb in pairs:
        a, b = on(ra), on(rb)
        flips["turned_on"] += a is False and b is True
        flips["turned_off"] += a is True and b is False
        if gold:
            right_a = a is not None and a == (name in ra.get("gold", ()))
            right_b = b is not None and b == (name in rb.get("gold", ()))
            fixed, broken = fixed + (right_b and not right_a), broken + (right_a and not right_b)
    if gold:
        flips.update(fixed=fixed, broken=broken, mcnemar_p=mcnemar_exact(broken, fixed))
    return flips


def _correct(record: Mapping[str, Any]) -> bool | None:
    if is_error(record):
        return False  # an item that could not be scored counts as wrong, as in the evaluation
    return bool(record["correct"]) if "correct" in record else None


def _evaluate(result: Comparison, graded: list[tuple[str, bool, bool]]) -> None:
    result.gold = True
    result.accuracy_a = sum(a for _, a, _ in graded) / len(graded)
    result.accuracy_b = sum(b for _, _, b in graded) / len(graded)
    result.fixed = [k for k, a, b in graded if not a and b]
    result.broken = [k for k, a, b in graded if a and not b]
    result.p_value = mcnemar_exact(len(result.broken), len(result.fixed))


def compare_outputs(path_a: str, path_b: str) -> Comparison | QuestionsComparison:
    """Read two outputs of `run` (JSONL or CSV) and compare them; a file that is not one is refused."""
    runs = []
    for path in (path_a, path_b):
        try:
            records = read_records(path, strict=True).records
        except FileNotFoundError:
            raise InputError(f"{path}: no such file")
        except OutputError as exc:
            raise InputError(str(exc))
        twice = repeated(records)
        if twice is not None:
            raise InputError(f"{path}: holds two records for item {twice['id']!r}; it was changed after it was "
                             f"written (or joined twice): compare outputs of one run each")
        runs.append(records)
    asked = question_ids(runs[0]), question_ids(runs[1])
    if any(asked):
        if asked[0] and asked[1] and asked[0] != asked[1]:
            raise InputError(f"{path_a} and {path_b} answer other questions ({', '.join(asked[0])} against "
                             f"{', '.join(asked[1])}): compare outputs of the same questions")
        if not (asked[0] and asked[1]) and all(not is_error(r) for run in runs for r in run):
            raise InputError(f"{path_a if not asked[0] else path_b} holds no answers to questions: compare outputs "
                             f"of the same kind of spec")
        return QuestionsComparison({q: compare(*[[question_view(r, q) for r in run] for run in runs])
                                    for q in asked[0] or asked[1]})
    return compare(*runs)


@dataclass
class QuestionsComparison:
    """Two typed-questions outputs compared question by question (each a `Comparison` of the
    question's answers in a word, its distribution and its gold)."""

    per_question: dict[str, Comparison]

    @property
    def gold(self) -> bool:
        return any(c.gold for c in self.per_question.values())

    def gate_failures(self, max_change: float | None = None, no_regression: bool = False) -> list[str]:
        if no_regression and not self.gold:
            raise UsageError("--fail-on-regression needs gold values in both outputs (run with --gold)")
        return [f"question {qid!r}: {failure}" for qid, c in self.per_question.items()
                for failure in c.gate_failures(max_change, no_regression and c.gold)]

    def to_json(self, top: int = 10) -> dict[str, Any]:
        return {"questions": {qid: c.to_json(top) for qid, c in self.per_question.items()}}

    def to_markdown(self, name_a: str, name_b: str, top: int = 10) -> str:
        return "".join(c.to_markdown(name_a, name_b, top).replace("### ", f"### question {cell(qid)}: ", 1)
                       for qid, c in self.per_question.items())


def write_diff_reports(cmp: Comparison | QuestionsComparison, name_a: str, name_b: str, md: Path | None, as_json: Path | None,
                       top: int = 10) -> None:
    """--md (appended) and --json, each listing `top` changed items (and shifts); neither may be
    one of the outputs compared."""
    check_distinct({"--md": md, "--json": as_json}, {"A": name_a, "B": name_b}, outputs=("A", "B"))
    check_report(md, "--md")
    check_report(as_json, "--json")
    if md:
        write_report_file(Path(md), cmp.to_markdown(name_a, name_b, top), append=True)
    if as_json:
        write_report_file(Path(as_json), json.dumps(cmp.to_json(top), indent=2, ensure_ascii=False) + "\n")
