"""Typed questions: a spec's `questions:` pack, in the System One shape, read and checked; what
the kinds share (the `Kind` contract and its registry, the answer's confidence); and what an
item's scores decide for each question. No torch here.

A pack maps question ids to questions:

    questions:
      team:    {type: choice, instructions: "Which team?", criteria: {billing: "Invoices", tech: null}}
      blocked: {type: noul, instructions: "Is the customer blocked?"}
      mood:    {type: score, instructions: "How upset?", criteria: [calm, annoyed, angry]}

Each kind lives in one module (choice_kind.py, noul_kind.py, score_kind.py) that owns its keys,
its prompt branch, the answers it scores, the answer it reports, its flat columns and its
metrics; the rest of the code works on `Question` and asks its `kind`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from ..errors import SpecError
from .decision import NORMALIZATIONS, Decision, judge
from .spec import DEFAULT_CONTENT_FREE

COMMON_KEYS = ("type", "instructions", "criteria", "normalize", "calibrate", "threshold", "gold", "read", "words", "list")
READS = ("text", "letters")


def shown(value: Any) -> str:
    """Instructions or a description as prompt text: strings as they are, objects and arrays as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Question:
    """One typed question of a pack.

    Attributes: id (never shown to the model), kind (its `Kind`), instructions (prompt text),
    options (what the answer is one of: option names, "yes"/"no", or level numbers "0".."n-1"),
    descriptions (per option, or None), said (per option, the texts scored for it: its words, its
    name, its letter or its number), normalize, content_free (calibration inputs; empty: none),
    threshold (choice: abstain below it), gold (the item field with the expected answer), read."""

    id: str
    kind: "Kind"
    instructions: str
    options: tuple[str, ...]
    descriptions: tuple[str | None, ...]
    said: tuple[tuple[str, ...], ...]
    normalize: str = "sum"
    content_free: tuple[str, ...] = ()
    threshold: float | None = None
    gold: str | None = None
    read: str = "text"
    extra: Mapping[str, Any] = field(default_factory=dict)  # kind-specific settings

    @property
    def type(self) -> str:
        return self.kind.name

    def branch(self) -> str:
        """The question as the model reads it after the item: its instructions and its options."""
        return self.kind.branch(self)

    def example_answer(self, value: Any, where: str) -> str:
        """What a few-shot example's answer to this question says (the option's first scored
        text). Raises SpecError for a value that is not one of its answers."""
        option = self.kind.option_of(self, value)
        if option is None:
            raise SpecError(f"{where} answers {self.id!r} with {value!r}, which is not one of its answers "
                            f"({', '.join(map(repr, self.kind.accepted(self)))})")
        return self.said[self.options.index(option)][0]


class Kind(Protocol):
    """What one kind of question owns. Each kind module defines one and registers it in KINDS."""

    name: str
    aliases: tuple[str, ...]

    def parse(self, qid: str, entry: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The kind's fields of a `Question` (options, descriptions, said, extra) from its entry."""

    def branch(self, question: Question) -> str:
        """The question's prompt text after the item."""

    def option_of(self, question: Question, value: Any) -> str | None:
        """The option a gold or example value names, or None."""

    def accepted(self, question: Question) -> tuple[str, ...]:
        """The values `option_of` takes, to name in messages."""

    def answer(self, question: Question, decision: Decision, logprobs: Sequence[float]) -> dict[str, Any]:
        """The answer in the System One shape (plus `x_logprobs`)."""

    def distribution(self, answer: Mapping[str, Any]) -> dict[str, float]:
        """The answer as a distribution over its options (noul: yes and no)."""

    def summary(self, question: Question, answer: Mapping[str, Any]) -> str:
        """The answer in a word, for the run's summary ("(abstained)" when it abstained)."""

    def correct(self, question: Question, answer: Mapping[str, Any], gold: str) -> bool | None:
        """Whether an answer is right against the gold option (None: it abstained)."""

    def columns(self, question: Question) -> list[str]:
        """The flat (CSV) columns of its answer, after the question id's own."""

    def metrics(self, question: Question, answers: Sequence[Mapping[str, Any]], golds: Sequence[str]) -> dict[str, Any]:
        """Its metrics over answered items with gold options."""


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    for name in (kind.name, *kind.aliases):
        KINDS[name] = kind
    return kind


def _kinds() -> dict[str, Kind]:
    from . import choice_kind, noul_kind, score_kind  # noqa: F401  (each registers itself)

    return KINDS


# -- confidence: the formulas the System One conformance suite pins --------------------------------
def choice_confidence(probs: Sequence[float]) -> float:
    """(max p - 1/n) / (1 - 1/n): 0 for a uniform answer, 1 for a certain one (1 when n <= 1)."""
    n = len(probs)
    if n <= 1:
        return 1.0
    return min(1.0, max(0.0, (max(probs) - 1 / n) / (1 - 1 / n)))


def score_confidence(probs: Sequence[float]) -> float:
    """max(0, 1 - sum p_i |i - m| / D), m the most probable level, D = (1/n) sum |i - (n-1)/2|:
    1 when every bit of probability is on one level, 0 at a spread as wide as a uniform one's."""
    n = len(probs)
    m = max(range(n), key=lambda i: (probs[i], -i))
    spread = sum(p * abs(i - m) for i, p in enumerate(probs))
    d = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, min(1.0, 1 - spread / d)) if d else 1.0


# -- reading a pack ------------------------------------------------------------------------------
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
    kinds = _kinds()
    kind = kinds.get(entry.get("type")) if isinstance(entry.get("type"), str) else None
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
    fields = kind.parse(qid, entry, at)
    if read == "letters" and kind.name != "choice":
        raise SpecError(f"{at}: 'read: letters' applies to choice questions")
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


def option_texts(entries: Any, at: str, least: int, most: int) -> list[tuple[str, Any]]:
    """A `criteria` mapping of option name -> description as (name, description) pairs, checked."""
    if not isinstance(entries, Mapping):
        raise SpecError(f"{at}: 'criteria' must be a mapping of option name to description (or null)")
    if not least <= len(entries) <= most:
        raise SpecError(f"{at} has {len(entries)} option{'s' * (len(entries) != 1)}; a question takes {least} to {most}")
    pairs = []
    for name, desc in entries.items():
        if isinstance(name, bool):
            raise SpecError(f"{at}: option {name!r} is how YAML reads an unquoted yes/no/true/false/on/off; quote it")
        if isinstance(name, (int, float)):
            name = str(name)
        if not isinstance(name, str) or not name.strip():
            raise SpecError(f"{at}: option {name!r} must be a non-empty string")
        pairs.append((name, desc))
    names = [n for n, _ in pairs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise SpecError(f"{at} lists option {dup!r} twice")
    return pairs


# -- deciding ------------------------------------------------------------------------------------
def decide_question(question: Question, logprobs: Sequence[float], token_counts: Sequence[int],
                    prior: Sequence[float] | None = None, unconditional: Sequence[float] = ()) -> Decision:
    """One question's distribution over its options from their summed log-probabilities (an
    option with several scored texts: the log of their summed probability); `unconditional`
    (`pmi`): the same after the content-free prompt."""
    members = question.said
    per_option = list(per_option_logprobs(question, logprobs).values())
    uncond = list(per_option_logprobs(question, unconditional).values()) if unconditional else []
    counts, at = [], 0
    for said in members:
        counts.append(sum(token_counts[at: at + len(said)]) / len(said))
        at += len(said)
    sizes = [sum(len(t) for t in said) / len(said) for said in members]
    if question.normalize == "bytes":
        sizes = [sum(len(t.encode("utf-8")) for t in said) / len(said) for said in members]
    return judge(per_option, question.normalize, counts, list(question.options), uncond, prior, question.threshold,
                 sizes)


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


@dataclass(frozen=True)
class Answers:
    """What an item's scores decide, per question (in pack order): its decision and the summed
    log-probability of each scored text."""

    questions: tuple[Question, ...]
    decisions: tuple[Decision, ...]
    logprobs: tuple[tuple[float, ...], ...]

    def answers(self) -> dict[str, dict[str, Any]]:
        """Question id -> answer in the System One shape."""
        return {q.id: q.kind.answer(q, d, lps) for q, d, lps in zip(self.questions, self.decisions, self.logprobs)}


def distribution_answer(question: Question, decision: Decision, logprobs: Sequence[float],
                        head: dict[str, Any]) -> dict[str, Any]:
    """A choice or score answer: `head` (its type and value), then its probabilities keyed by
    the options, the confidence `head` holds, the raw probabilities when calibrated and `x_logprobs`."""
    out = {**head, "probabilities": dict(zip(question.options, decision.probs))}
    out["confidence"] = out.pop("confidence")
    if decision.raw is not None:
        out["x_raw_probabilities"] = dict(zip(question.options, decision.raw))
    out["x_logprobs"] = per_option_logprobs(question, logprobs)
    return out


def per_option_logprobs(question: Question, logprobs: Sequence[float]) -> dict[str, float]:
    """`x_logprobs`: each option's summed log-probability before normalisation (several scored
    texts: the log of their summed probability)."""
    out, at = {}, 0
    for option, said in zip(question.options, question.said):
        part = list(logprobs[at: at + len(said)])
        out[option] = part[0] if len(part) == 1 else _logsumexp(part)
        at += len(said)
    return out


def answer_word(answer: Mapping[str, Any]) -> str:
    """An answer in a word (its kind's `summary`), read from the answer alone."""
    return _kinds()[answer["type"]].summary(None, answer)


def answer_distribution(answer: Mapping[str, Any]) -> dict[str, float]:
    """An answer as a distribution over its options (its kind's `distribution`), read from the answer alone."""
    return _kinds()[answer["type"]].distribution(answer)
