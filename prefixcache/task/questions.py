"""Typed questions: a spec's `questions:` pack, in the System One shape, read and checked, and
what an item's scores decide for each question (`Answers`). No torch here.

A pack maps question ids to questions:

    questions:
      team:    {type: choice, instructions: "Which team?", criteria: {billing: "Invoices", tech: null}}
      blocked: {type: noul, instructions: "Is the customer blocked?"}
      mood:    {type: score, instructions: "How upset?", criteria: [calm, annoyed, angry]}

Each kind lives in one module (choice_kind.py, noul_kind.py, score_kind.py) that owns its keys,
its prompt branch, the answers it scores, the answer it reports, its flat columns and its
metrics, and registers itself (kind.py holds the contract and what the kinds share); the rest of
the code works on `Question` and asks its `kind`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import SpecError
from . import choice_kind, labels_kind, noul_kind, options_kind, score_kind, tags_kind  # noqa: F401  (typed kinds register)
from .decision import DEFAULT_CONTENT_FREE, NORMALIZATIONS, Decision, Tags
from .kind import KINDS, Question, SpecKind, pack_kind, shown

COMMON_KEYS = ("type", "instructions", "criteria", "normalize", "calibrate", "threshold", "gold", "read", "words", "list")
READS = ("text", "letters")


def parse_pack(value: Any, where: str, normalize: str = "sum", calibrate: Any = None) -> tuple[Question, ...]:
    """The questions of a `questions:` mapping; `normalize` and `calibrate` are the spec's
    defaults. Raises SpecError naming `where` and the question id."""
    if not isinstance(value, Mapping) or not value:
        raise SpecError(f"{where}: 'questions' must be a mapping of question id to question (at least one)")
    out = []
    for qid, entry in value.items():
        if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
            raise SpecError(f"{where}: question id {qid!r} must be a non-empty string (quote yes/no/true/false)")
        out.append(parse_question(str(qid), entry, where, normalize, calibrate))
    return tuple(out)


def parse_question(qid: str, entry: Any, where: str, normalize: str = "sum", calibrate: Any = None) -> Question:
    at = f"{where}: question {qid!r}"
    if not isinstance(entry, Mapping):
        raise SpecError(f"{at} must be a mapping with a 'type' (choice, noul or score)")
    kinds = KINDS
    named = entry.get("type")
    kind = kinds.get(named) if isinstance(named, str) else None
    if kind is None:
        raise SpecError(f"{at} has type {entry.get('type')!r}; the types are {', '.join(sorted(kinds))}")
    unknown = [k for k in entry if k not in COMMON_KEYS]
    if unknown:
        raise SpecError(f"{at} has unknown key {unknown[0]!r} (a question takes {', '.join(COMMON_KEYS)})")
    read = entry.get("read", "text")
    if read not in READS:
        raise SpecError(f"{at}: 'read' must be text (score each option's text) or letters (show A., B., ... and "
                        f"score the letter), got {read!r}")
    norm = entry.get("normalize", normalize)
    if norm not in NORMALIZATIONS:
        raise SpecError(f"{at}: 'normalize' must be one of {', '.join(NORMALIZATIONS)}, got {norm!r}")
    gold = entry.get("gold")
    if gold is not None and (not isinstance(gold, str) or not gold):
        raise SpecError(f"{at}: 'gold' must name the item field with the expected answer")
    if entry.get("threshold") is not None and not kind.abstains:
        takers = sorted(k.name for k in KINDS.values() if k.abstains)
        raise SpecError(f"{at}: 'threshold' applies to {' and '.join(takers)} questions, whose answer can abstain; "
                        f"a {kind.name} question always answers")
    fields = kind.parse(qid, entry, at)
    if read not in kind.reads:
        takers = sorted({k.name for k in KINDS.values() if read in k.reads})
        raise SpecError(f"{at}: 'read: {read}' applies to {' and '.join(takers)} questions")
    return Question(id=qid, kind=kind, instructions=shown(entry.get("instructions")), normalize=norm,
                    content_free=content_free_value(entry.get("calibrate", calibrate), at),
                    threshold=threshold_value(entry.get("threshold"), at), gold=gold, read=read, **fields)


def content_free_value(value: Any, at: str) -> tuple[str, ...]:
    """A `calibrate` value: true (the default content-free inputs), false, or a list of them."""
    if value is None or value is False:
        return ()
    if value is True:
        return DEFAULT_CONTENT_FREE
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(f"{at}: 'calibrate' must be true, false or a list of content-free inputs like [\"N/A\", \"\"]")


def threshold_value(value: Any, at: str) -> float | None:
    """A `threshold` value: a probability in (0, 1], or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise SpecError(f"{at}: 'threshold' must be a probability in (0, 1], got {value!r}")
    return float(value)


# -- deciding ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answers:
    """What an item's scores decide, per question asked (a pack's questions in order, or a label
    spec's one question): its decision and each option's log-probability (its scored texts
    combined)."""

    questions: tuple[Question, ...]
    decisions: tuple[Decision | Tags, ...]
    logprobs: tuple[tuple[float, ...] | None, ...]  # None: a head answered alone (no option scored)
    novelty: tuple[float | None, ...] = ()  # per question a head read: how far the item lies from its fitted rows

    def answers(self) -> dict[str, dict[str, Any]]:
        """Question id -> answer in the System One shape."""
        out = {}
        for q, d, lps in zip(self.questions, self.decisions, self.logprobs, strict=True):
            assert isinstance(d, Decision), "a pack's kinds decide one option"
            out[q.id] = pack_kind(q).answer(q, d, lps)
        return out

    def bounded(self, indices: Sequence[int]) -> dict[str, list[str]]:
        """Question id -> its options whose log-probs are bounds (pruned scoring), from their
        indices in the item's options (the questions' options one after another)."""
        out: dict[str, list[str]] = {}
        at = 0
        for q in self.questions:
            picked = [q.options[i - at] for i in indices if at <= i < at + len(q.options)]
            if picked:
                out[q.id] = picked
            at += len(q.options)
        return out

    def decision_logs(self) -> list[tuple[list[float], float | None]]:
        """Every call the item's answers make, with the log-threshold each is held to (`--exact`)."""
        return [entry for q, d in zip(self.questions, self.decisions) for entry in q.kind.decision_logs(q, d)]


def answer_word(answer: Mapping[str, Any]) -> str:
    """An answer in a word (its kind's `summary`), read from the answer alone."""
    return KINDS[answer["type"]].summary(answer)


def answer_distribution(answer: Mapping[str, Any]) -> dict[str, float]:
    """An answer as a distribution over its options (its kind's `distribution`), read from the answer alone."""
    return KINDS[answer["type"]].distribution(answer)


def label_kind(spec: Any) -> SpecKind:
    """The kind of a label spec's one question: its labels, its labels judged one by one
    (multi-label), or each item's own options (multiple choice)."""
    return options_kind.OPTIONS if spec.choices else tags_kind.TAGS if spec.multi_label else labels_kind.LABELS
