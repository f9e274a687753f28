"""What every kind of typed question shares: the `Question`, the contract each kind module
fulfils (`Kind`, and `PackKind` for a pack's kinds or `SpecKind` for a label spec's) and the
registry a pack's kinds join, the confidence formulas the System One conformance suite pins,
and the helpers the kinds build their options and answers with. No torch here.

The kinds: choice_kind.py, noul_kind.py, score_kind.py; a pack is read in questions.py. A spec
with labels (or choices) is the one-question case of the same path: labels_kind.py, tags_kind.py
and options_kind.py each decide its one question and write the records as label specs write them
(they are built from the spec, never named in a pack).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..errors import SpecError
from .decision import Decision, Groups, Tags, judge
from .texts import twice, twins


def shown(value: Any) -> str:
    """Instructions or a description as prompt text: strings as they are, objects and arrays as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    return json.dumps(value, ensure_ascii=False)


COLLAPSE_SHARE, COLLAPSE_MIN_ITEMS = 0.9, 20  # a collapse warning: this share of at least this many items gets one answer


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

    @property
    def gold_field(self) -> str:
        """The item field with its expected answer (a graded question's; ValueError for one without)."""
        if self.gold is None:
            raise ValueError(f"question {self.id!r} has no gold field")
        return self.gold

    @functools.cached_property
    def groups(self) -> Groups:
        """Which of its scored texts (in order, option by option) make each option's score."""
        members, at = [], 0
        for said in self.said:
            members.append(tuple(range(at, at + len(said))))
            at += len(said)
        return Groups(self.options, tuple(members), "forms")

    @property
    def texts(self) -> list[str]:
        """Its scored texts, in order, option by option."""
        return [text for said in self.said for text in said]

    def branch(self) -> str:
        """The question as the model reads it after the item: its instructions and its options."""
        return pack_kind(self).branch(self)

    def example_answer(self, value: Any, where: str) -> str:
        """What a few-shot example's answer to this question says (the option's first scored
        text). Raises SpecError for a value that is not one of its answers."""
        kind = pack_kind(self)
        option = kind.option_of(self, value)
        if option is None:
            raise SpecError(f"{where} answers {self.id!r} with {value!r}, which is not one of its answers "
                            f"({', '.join(map(repr, kind.accepted(self)))})")
        return self.said[self.options.index(option)][0]


class Kind(Protocol):
    """What every question's kind owns, a pack's typed kinds and a label spec's alike: how its
    options' log-probabilities decide, and the traits scoring, fitting and the records read.
    A pack's kinds are `PackKind`s (registered in KINDS); a label spec's are `SpecKind`s."""

    @property
    def name(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...
    @property
    def abstains(self) -> bool:
        """Its answer may abstain below a `threshold`."""
    @property
    def races(self) -> bool:
        """Pruned scoring may race its options (those whose options have one text each)."""
    @property
    def reads(self) -> tuple[str, ...]:
        """The `read` values it takes."""
    @property
    def collapses(self) -> bool:
        """One answer for most items hints at a biased model (not so for levels)."""
    @property
    def judged_each(self) -> bool:
        """Each option is a yes/no call of its own (a fitted head reads one state per option)."""

    def decide(self, question: Question, logprobs: Sequence[float], counts: Sequence[int],
               unconditional: Sequence[float] = (), prior: Sequence[float] | None = None) -> Decision | Tags:
        """What its options' log-probabilities decide (`logprobs`: one per option, its scored
        texts already combined; `counts`, `unconditional`: one per scored text, its answer's
        tokens and, for `pmi`, its log-probability after the content-free prompt)."""

    def decision_logs(self, question: Question, decision: Decision | Tags) -> list[tuple[list[float], float | None]]:
        """Each call its decision makes, as log-probabilities, with the log-threshold it is held
        to (None: none): what `--exact` measures a close call and a rounding shift on."""


class PackKind(Kind, Protocol):
    """What one kind of a pack's typed questions owns. Each kind module defines one and registers
    it in KINDS."""

    def parse(self, qid: str, entry: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The kind's fields of a `Question` (options, descriptions, said, extra) from its entry."""

    def branch(self, question: Question) -> str:
        """The question's prompt text after the item."""

    def option_of(self, question: Question, value: Any) -> str | None:
        """The option a gold or example value names, or None."""

    def accepted(self, question: Question) -> tuple[str, ...]:
        """The values `option_of` takes, to name in messages."""

    def answer(self, question: Question, decision: Decision, logprobs: Sequence[float] | None) -> dict[str, Any]:
        """The answer in the System One shape (plus `x_logprobs`)."""

    def distribution(self, answer: Mapping[str, Any]) -> dict[str, float]:
        """The answer as a distribution over its options (noul: yes and no)."""

    def summary(self, answer: Mapping[str, Any]) -> str:
        """The answer in a word, for the run's summary ("(abstained)" when it abstained)."""

    def correct(self, question: Question, answer: Mapping[str, Any], gold: str) -> bool | None:
        """Whether an answer is right against the gold option (None: it abstained)."""

    def columns(self, question: Question) -> list[str]:
        """The flat (CSV) columns of its answer, after the question id's own."""

    def metrics(self, question: Question, answers: Sequence[Mapping[str, Any]], golds: Sequence[str]) -> dict[str, Any]:
        """Its metrics over answered items with gold options."""

    def value_of(self, cell: str) -> Any:
        """Its answer's value from a CSV cell (the inverse of writing `answer[type]`)."""

    def figures(self, metrics: Mapping[str, Any]) -> str:
        """What its metrics say beyond accuracy and calibration, in words."""


class SpecKind(Kind, Protocol):
    """The kind of a label spec's one question (its labels, its labels judged one by one, or each
    item's own options): it builds the question from the spec and writes the record's layout."""

    def question(self, spec: Any, options: Sequence[str] = ()) -> Question:
        """The spec's one question (`options`: an item's own, multiple choice)."""

    def record(self, question: Question, spec: Any, fields: Mapping[str, Any], decision: Any,
               logprobs: Sequence[float] | None) -> dict[str, Any]:
        """The record's fields after the id and the kept input fields (`logprobs` None: a head
        answered alone)."""

    def prediction(self, question: Question, decision: Any) -> str | None:
        """What the decision predicts, as text (None: it abstained)."""

    def columns(self, spec: Any) -> tuple[list[str], list[str]]:
        """Its record's CSV columns: those before the per-option ones, and the per-option ones."""

    def table(self, spec: Any) -> Sequence[tuple[str, Callable[[Mapping[str, Any]], Any]]]:
        """The columns a table of predictions gets (Classifier), each with how a record fills it."""


class Asked:
    """What a kind decides by default: its options' distribution under its normalisation and
    calibration (`decide_question`), and each decision as the logs of that distribution with its
    abstention threshold, with the traits (`Kind`'s attributes) most kinds share. The typed kinds
    and a label spec's kinds build on it and override what sets them apart."""

    aliases: tuple[str, ...] = ()
    races = False
    reads: tuple[str, ...] = ("text",)
    collapses = True
    judged_each = False
    abstains = False  # one of its options, not a number

    def __repr__(self) -> str:
        # its name: a spec's repr is what keys kept bounds and fingerprints, the same in every process
        return f"<kind {getattr(self, 'name', type(self).__name__)}>"

    def value_of(self, cell: str) -> Any:
        """Its answer's value from a CSV cell (the inverse of writing `answer[type]`)."""
        return float(cell)

    def figures(self, metrics: Mapping[str, Any]) -> str:
        """What its metrics say beyond accuracy and calibration, in words."""
        return ""

    def decide(self, question: Question, logprobs: Sequence[float], counts: Sequence[int],
               unconditional: Sequence[float] = (), prior: Sequence[float] | None = None) -> Decision | Tags:
        return decide_question(question, logprobs, counts, prior, unconditional)

    def decision_logs(self, question: Question, decision: Decision | Tags) -> list[tuple[list[float], float | None]]:
        threshold = question.threshold
        return [([math.log(max(p, 1e-300)) for p in decision.probs], None if threshold is None else math.log(threshold))]


def decide_question(question: Question, logprobs: Sequence[float], token_counts: Sequence[int],
                    prior: Sequence[float] | None = None, unconditional: Sequence[float] = ()) -> Decision:
    """One question's distribution over its options from their log-probabilities (an option with
    several scored texts: the log of their summed probability); `token_counts` and
    `unconditional` (`pmi`: after the content-free prompt) are per scored text, combined here."""
    groups = question.groups
    size = len if question.normalize != "bytes" else (lambda text: len(text.encode("utf-8")))
    return judge(list(logprobs), question.normalize, groups.combine_lengths(token_counts), list(question.options),
                 groups.combine(unconditional) if unconditional else [], prior, question.threshold,
                 groups.combine_lengths([size(t) for t in question.texts]))


KINDS: dict[str, PackKind] = {}


def register(kind: PackKind) -> PackKind:
    """Add a question kind under its name and aliases; a name taken already is refused (ValueError)."""
    taken = [name for name in (kind.name, *kind.aliases) if name in KINDS]
    if taken:
        raise ValueError(f"a question kind named {taken[0]!r} is registered already")
    for name in (kind.name, *kind.aliases):
        KINDS[name] = kind
    return kind


def pack_kind(question: Question) -> PackKind:
    """A pack question's kind with its typed answers' members (it is the one registered under
    its name); a label spec's question has none of them (TypeError)."""
    kind = KINDS.get(question.kind.name)
    if kind is not question.kind:
        raise TypeError(f"question {question.id!r} is a label spec's ({question.kind.name}), not a pack's")
    return kind


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
    pair = twins(n for n, _ in pairs)
    if pair is not None:
        raise SpecError(f"{at} {twice('option', pair)}")
    return pairs


def distribution_answer(question: Question, decision: Decision, logprobs: Sequence[float] | None,
                        head: dict[str, Any]) -> dict[str, Any]:
    """A choice or score answer: `head` (its type and value), then its probabilities keyed by
    the options, the confidence `head` holds, the raw probabilities when calibrated and `x_logprobs`."""
    out = {**head, "probabilities": dict(zip(question.options, decision.probs))}
    out["confidence"] = out.pop("confidence")
    if decision.raw is not None:
        out["x_raw_probabilities"] = dict(zip(question.options, decision.raw))
    if logprobs is not None:  # None: a head answered alone, no option was scored
        out["x_logprobs"] = per_option_logprobs(question, logprobs)
    return out


def per_option_logprobs(question: Question, logprobs: Sequence[float]) -> dict[str, float]:
    """`x_logprobs`: each option's log-probability before normalisation (several scored texts:
    the log of their summed probability, as the option's scores arrive)."""
    return dict(zip(question.options, logprobs))
