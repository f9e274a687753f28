"""The `noul` question (yes/no; `predicate` is the same): P(yes) against no, the two answers
scored after the question. No torch here."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from ..errors import SpecError
from .decision import Decision
from .kind import Asked, Question, per_option_logprobs, register, shown
from .scoring_metrics import calibration_error

YES, NO = "yes", "no"
_TRUE = (True, 1, "true", "yes", "True", "Yes", "TRUE", "YES", "1")
_FALSE = (False, 0, "false", "no", "False", "No", "FALSE", "NO", "0")


class NoulKind(Asked):
    name = "noul"
    aliases = ("predicate",)

    def parse(self, qid: str, entry: Mapping[str, Any], at: str) -> dict[str, Any]:
        criteria = entry.get("criteria")
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, Mapping):
            raise SpecError(f"{at}: a noul question's 'criteria' must be a mapping with 'true' and/or 'false' descriptions")
        sides: dict[str, str | None] = {YES: None, NO: None}
        for key, desc in criteria.items():
            side = YES if key in (True, "true") else NO if key in (False, "false") else None
            if side is None:
                raise SpecError(f"{at}: a noul question's 'criteria' take 'true' and 'false', not {key!r}")
            sides[side] = shown(desc) or None
        if not shown(entry.get("instructions")) and not any(sides.values()):
            raise SpecError(f"{at}: a noul question needs 'instructions' or a described outcome in 'criteria'")
        if "list" in entry:
            raise SpecError(f"{at}: 'list' applies to choice questions")
        if entry.get("words") is not None:
            raise SpecError(f"{at}: 'words' apply to choice questions; a noul question scores yes and no")
        return dict(options=(YES, NO), descriptions=(sides[YES], sides[NO]), said=((YES,), (NO,)))

    def branch(self, q: Question) -> str:
        lines = [q.instructions] if q.instructions else []
        if q.descriptions[0]:
            lines.append(f"Yes means: {q.descriptions[0]}")
        if q.descriptions[1]:
            lines.append(f"No means: {q.descriptions[1]}")
        return "\n".join(lines + ["Answer yes or no."])

    def option_of(self, q: Question, value: Any) -> str | None:
        if isinstance(value, float) and value in (0.0, 1.0):
            value = int(value)
        if any(value is v or (type(value) is type(v) and value == v) for v in _TRUE):
            return YES
        if any(value is v or (type(value) is type(v) and value == v) for v in _FALSE):
            return NO
        return None

    def accepted(self, q: Question) -> tuple[str, ...]:
        return ("true", "false", "yes", "no")

    def answer(self, q: Question, decision: Decision, logprobs: Sequence[float] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "noul", "noul": decision.probs[0]}
        if decision.raw is not None:
            out["x_raw_noul"] = decision.raw[0]
        if logprobs is not None:  # None: a head answered alone
            out["x_logprobs"] = per_option_logprobs(q, logprobs)
        return out

    def figures(self, metrics: Mapping[str, Any]) -> str:
        return f"Brier {metrics['brier']:.3f}, log loss {metrics['log_loss']:.3f}"

    def distribution(self, answer: Mapping[str, Any]) -> dict[str, float]:
        return {YES: answer["noul"], NO: 1 - answer["noul"]}

    def summary(self, answer: Mapping[str, Any]) -> str:
        return YES if answer["noul"] >= 0.5 else NO

    def correct(self, q: Question, answer: Mapping[str, Any], gold: str) -> bool | None:
        return (answer["noul"] >= 0.5) == (gold == YES)

    def columns(self, q: Question) -> list[str]:
        return (["raw"] if q.content_free else []) + [f"lp__{YES}", f"lp__{NO}"]

    def metrics(self, q: Question, answers: Sequence[Mapping[str, Any]], golds: Sequence[str]) -> dict[str, Any]:
        p = [min(max(a["noul"], 1e-15), 1 - 1e-15) for a in answers]
        y = [g == YES for g in golds]
        n = len(p)
        right = [(pi >= 0.5) == yi for pi, yi in zip(p, y)]
        return {"accuracy": sum(right) / n if n else 0.0,
                "brier": sum((pi - yi) ** 2 for pi, yi in zip(p, y)) / n if n else 0.0,
                "log_loss": -sum(math.log(pi) if yi else math.log(1 - pi) for pi, yi in zip(p, y)) / n if n else 0.0,
                "ece": calibration_error([max(pi, 1 - pi) for pi in p], right)}


register(NoulKind())
