"""The `score` question: an ordered list of 2 to 10 level descriptions, level i scoring i; each
level's number is scored, and the answer's score is the expected level. No torch here."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import SpecError
from .decision import Decision
from .kind import Asked, Question, distribution_answer, register, score_confidence, shown
from .scoring_metrics import calibration_error

LEAST, MOST = 2, 10


class ScoreKind(Asked):
    name = "score"
    aliases: tuple[str, ...] = ()
    collapses = False  # levels may well pile up

    def parse(self, qid: str, entry: Mapping[str, Any], at: str) -> dict[str, Any]:
        levels = entry.get("criteria")
        if isinstance(levels, Mapping):
            raise SpecError(f"{at}: a score question's 'criteria' must be a list of level descriptions (level i "
                            f"scores i), not a mapping")
        if not isinstance(levels, list) or not LEAST <= len(levels) <= MOST:
            n = len(levels) if isinstance(levels, list) else 0
            raise SpecError(f"{at} has {n} level{'s' * (n != 1)}; a score question takes a list of {LEAST} to {MOST}")
        if any(not shown(level) for level in levels):
            raise SpecError(f"{at}: every level of a score question needs a description")
        if "list" in entry:
            raise SpecError(f"{at}: 'list' applies to choice questions")
        if entry.get("words") is not None:
            raise SpecError(f"{at}: 'words' apply to choice questions; a score question scores its levels' numbers")
        options = tuple(str(i) for i in range(len(levels)))
        return dict(options=options, descriptions=tuple(shown(level) for level in levels),
                    said=tuple((o,) for o in options))

    def branch(self, q: Question) -> str:
        head = f"{q.instructions}\n" if q.instructions else ""
        lines = [f"{i}: {desc}" for i, desc in enumerate(q.descriptions)]
        return head + f"Answer with one number from 0 to {len(q.options) - 1}:\n" + "\n".join(lines)

    def option_of(self, q: Question, value: Any) -> str | None:
        if isinstance(value, bool):
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        text = str(value).strip() if isinstance(value, (int, str)) else None
        if text in q.options:
            return text
        return next((o for o, d in zip(q.options, q.descriptions) if d == text), None)

    def accepted(self, q: Question) -> tuple[str, ...]:
        return q.options

    def answer(self, q: Question, decision: Decision, logprobs: Sequence[float] | None) -> dict[str, Any]:
        probs = decision.probs
        return distribution_answer(q, decision, logprobs, {
            "type": "score", "score": sum(i * p for i, p in enumerate(probs)), "legend": dict(zip(q.options, q.descriptions)),
            "confidence": score_confidence(probs)})

    def figures(self, metrics: Mapping[str, Any]) -> str:
        return f"MAE {metrics['mae']:.3f}"

    def distribution(self, answer: Mapping[str, Any]) -> dict[str, float]:
        return dict(answer["probabilities"])

    def summary(self, answer: Mapping[str, Any]) -> str:
        return top_level(answer)

    def correct(self, q: Question, answer: Mapping[str, Any], gold: str) -> bool | None:
        return top_level(answer) == gold

    def columns(self, q: Question) -> list[str]:
        return (["legend", "confidence"] + [f"p__{o}" for o in q.options]
                + ([f"raw__{o}" for o in q.options] if q.content_free else []) + [f"lp__{o}" for o in q.options])

    def metrics(self, q: Question, answers: Sequence[Mapping[str, Any]], golds: Sequence[str]) -> dict[str, Any]:
        n = len(answers)
        right = [top_level(a) == g for a, g in zip(answers, golds)]
        return {"accuracy": sum(right) / n if n else 0.0,
                "mae": sum(abs(a["score"] - int(g)) for a, g in zip(answers, golds)) / n if n else 0.0,
                "ece": calibration_error([max(a["probabilities"].values()) for a in answers], right)}


def top_level(answer: Mapping[str, Any]) -> str:
    """The most probable level (ties: the lowest)."""
    probs = answer["probabilities"]
    return max(probs, key=lambda k: (probs[k], -int(k)))


register(ScoreKind())
