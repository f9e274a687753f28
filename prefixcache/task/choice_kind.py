"""The `choice` question: one of 2 to 255 named options, each scored as its whole text (or its
words, or with `read: letters` its letter). No torch here."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import SpecError
from .decision import Decision
from .kind import Asked, Question, choice_confidence, distribution_answer, option_texts, register, shown
from .scoring_metrics import calibration_error, per_class

MOST = 255


def letter(i: int) -> str:
    """A, B, ..., Z, then AA, AB, ...: the code of option i in a lettered listing."""
    code = ""
    i += 1
    while i:
        i, rest = divmod(i - 1, 26)
        code = chr(65 + rest) + code
    return code


class ChoiceKind(Asked):
    name = "choice"
    races = True
    abstains = True
    reads = ("text", "letters")
    aliases: tuple[str, ...] = ()

    def parse(self, qid: str, entry: Mapping[str, Any], at: str) -> dict[str, Any]:
        pairs = option_texts(entry.get("criteria"), at, 2, MOST)
        names = [n for n, _ in pairs]
        words = entry.get("words") or {}
        if not isinstance(words, Mapping):
            raise SpecError(f"{at}: 'words' must map options to the words scored for them")
        for name, forms in words.items():
            if name not in names:
                raise SpecError(f"{at}: 'words' names {name!r}, which is not one of its options")
            if not isinstance(forms, list) or not forms or not all(isinstance(w, str) and w.strip() for w in forms):
                raise SpecError(f"{at}: 'words' of option {name!r} must be a non-empty list of non-empty strings")
        if entry.get("read") == "letters":
            if words:
                raise SpecError(f"{at}: 'words' cannot apply with 'read: letters' (the letters are scored)")
            said = tuple((letter(i),) for i in range(len(names)))
        else:
            said = tuple(tuple(dict.fromkeys(words.get(n) or [n])) for n in names)
        seen: dict[str, str] = {}
        for name, forms in zip(names, said):
            for form in forms:
                if form in seen:
                    raise SpecError(f"{at}: options {seen[form]!r} and {name!r} are both scored as {form!r}")
                seen[form] = name
        listed = entry.get("list", True)
        if not isinstance(listed, bool):
            raise SpecError(f"{at}: 'list' must be true (the options and descriptions are shown after the "
                            f"instructions) or false (only the instructions; each option is scored as it is)")
        if not listed and entry.get("read") == "letters":
            raise SpecError(f"{at}: 'read: letters' shows the lettered options: 'list: false' cannot apply")
        return dict(options=tuple(names), descriptions=tuple(shown(d) or None for _, d in pairs), said=said,
                    extra={"list": listed})

    def branch(self, q: Question) -> str:
        head = f"{q.instructions}\n" if q.instructions else ""
        if q.read == "letters":
            lines = [f"{letter(i)}. {name}" + (f" - {desc}" if desc else "")
                     for i, (name, desc) in enumerate(zip(q.options, q.descriptions))]
            return head + "\n".join(lines) + "\nAnswer with the letter of one option."
        if not q.extra.get("list", True):
            return q.instructions or "Answer:"
        lines = [f"- {name}: {desc}" if desc else f"- {name}" for name, desc in zip(q.options, q.descriptions)]
        return head + "Answer with exactly one of these options:\n" + "\n".join(lines)

    def option_of(self, q: Question, value: Any) -> str | None:
        text = str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        return text if text in q.options else None

    def accepted(self, q: Question) -> tuple[str, ...]:
        return q.options

    def answer(self, q: Question, decision: Decision, logprobs: Sequence[float] | None) -> dict[str, Any]:
        return distribution_answer(q, decision, logprobs, {
            "type": "choice", "choice": None if decision.best is None else q.options[decision.best],
            "confidence": choice_confidence(decision.probs)})

    def value_of(self, cell: str) -> Any:
        return cell or None  # an empty cell: it abstained

    def figures(self, metrics: Mapping[str, Any]) -> str:
        return f"macro-F1 {metrics['macro_f1']:.3f}, coverage {metrics['coverage']:.3f}"

    def distribution(self, answer: Mapping[str, Any]) -> dict[str, float]:
        return dict(answer["probabilities"])

    def summary(self, answer: Mapping[str, Any]) -> str:
        return "(abstained)" if answer["choice"] is None else answer["choice"]

    def correct(self, q: Question, answer: Mapping[str, Any], gold: str) -> bool | None:
        return None if answer["choice"] is None else answer["choice"] == gold

    def columns(self, q: Question) -> list[str]:
        return (["confidence"] + [f"p__{o}" for o in q.options]
                + ([f"raw__{o}" for o in q.options] if q.content_free else []) + [f"lp__{o}" for o in q.options])

    def metrics(self, q: Question, answers: Sequence[Mapping[str, Any]], golds: Sequence[str]) -> dict[str, Any]:
        said = [a["choice"] for a in answers]
        tops = [max(a["probabilities"].values()) for a in answers]
        return {**per_class(q.options, said, golds), "ece": calibration_error(tops, [s == g for s, g in zip(said, golds)])}


register(ChoiceKind())
