"""The task spec: the frozen, validated `TaskSpec` (built from a mapping in keys.py, from the
file in specfile.py), and what an item's fields mean to it (options, gold values). No torch here.

Validation happens before any model is loaded, so a typo costs the user a second, not a minute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence


from ..errors import InputError
from .kind import pack_kind
from .texts import twice, twins


if TYPE_CHECKING:
    from .head import Head
    from .kind import Question

FORMATS = ("auto", "chat", "plain")
ITEM_EXTENSIONS = (".jsonl", ".ndjson", ".csv", ".tsv", ".parquet")  # never a spec (a .json may be one)

KNOWN_KEYS = (
    "model",
    "revision",
    "backend",
    "system",
    "labels",
    "examples",
    "template",
    "id_field",
    "format",
    "normalize",
    "answer_prefix",
    "choices",
    "score_by",
    "gold",
    "calibrate",
    "threshold",
    "trust_remote_code",
    "multi_label",
    "question",
    "answers",
    "gold_sep",
    "questions",
    "head",
)
DEFAULT_QUESTION = "Is this about {label}?"
DEFAULT_ANSWERS = ("yes", "no")
DEFAULT_GOLD_SEP = ","
DEFAULT_ANSWER_PREFIX = "Answer:"  # the plain layout's line before the answer
PRUNING = ("on", "exact")  # the --prune modes that race (TaskSpec.prunes)


@dataclass(frozen=True)
class Label:
    name: str
    description: str | None = None
    words: tuple[str, ...] = ()  # the surface forms scored for it (a verbalizer); empty: its name

    @property
    def forms(self) -> tuple[str, ...]:
        """What is scored for the label: its words, else its name."""
        return self.words or (self.name,)


@dataclass(frozen=True)
class Template:
    """A `{field}` template. Rendering is plain substitution: no attribute access, no code."""

    text: str
    parts: tuple[tuple[str, str | None], ...]  # (literal text, field name or None)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for _, f in self.parts if f is not None))

    def render(self, record: Mapping[str, Any], item_id: object = None) -> str:
        out = []
        for literal, field in self.parts:
            out.append(literal)
            if field is None:
                continue
            if field not in record:
                raise InputError(f"item {item_id!r}: missing field {field!r} used by the template")
            out.append(field_text(record[field]))
        return "".join(out)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_missing(value: Any) -> bool:
    """A missing value: None, or what pandas and NumPy write for one (NaN, pd.NA, NaT)."""
    if value is None:
        return True
    if isinstance(value, float):
        return value != value  # NaN
    return type(value).__name__ in ("NAType", "NaTType")


@dataclass(frozen=True)
class TaskSpec:
    path: str
    model: str | None
    system: str
    labels: tuple[Label, ...]
    examples: tuple[Mapping[str, Any], ...]
    template: Template
    id_field: str = "id"
    id_field_given: bool = False  # the spec names id_field (then items must carry it)
    format: str = "auto"
    normalize: str = "sum"
    answer_prefix: str = DEFAULT_ANSWER_PREFIX
    trust_remote_code: bool = False
    choices: str | None = None  # item field holding the item's own options (multiple choice)
    gold: str | None = None  # item field holding the expected label or option text
    content_free: tuple[str, ...] = ()  # calibration inputs; empty: no calibration
    threshold: float | None = None  # abstain below this probability
    revision: str | None = None  # a hub model's branch, tag or commit
    backend: str | None = None  # what runs the model: "transformers", "llama.cpp" or "auto" (None: auto)
    score_by: str = "text"  # multiple choice: score each option's "text" (cloze) or its "letter" (A, B, ...)
    multi_label: bool = False  # each label judged on its own by a yes/no question (tagging)
    question: str = DEFAULT_QUESTION  # multi-label: the question asked per label, with {label}
    answers: tuple[str, str] = DEFAULT_ANSWERS  # multi-label: the answers scored for on and off
    tag_thresholds: tuple[float, ...] = ()  # multi-label: the probability each label needs to be on
    gold_sep: str = DEFAULT_GOLD_SEP  # multi-label: what separates labels in a gold string
    digest: str | None = None  # sha256 of the spec file's bytes (None: not read from a file)
    questions: tuple[Question, ...] = ()  # typed questions (task/questions.py); then no labels
    head: Head | None = None  # a fitted readout (task/head.py): decides from hidden states

    @property
    def has_gold(self) -> bool:
        """Items carry expected answers: the spec's gold field, or a question's."""
        return bool(self.gold) or any(q.gold for q in self.questions)

    def question_named(self, qid: str) -> Question:
        return next(q for q in self.questions if q.id == qid)

    def pruning_refusal(self) -> str | None:
        """Why pruned label scoring cannot apply to this task, or None."""
        if self.head is not None:
            return "a fitted head reads every item's states, and its records keep every option's prompt score"
        if self.questions:
            if any(q.kind.races and q.groups.plain for q in self.questions):
                return None
            return "only choice questions whose options have one text each are pruned, and this pack has none"
        if self.choices:
            return "multiple choice scores each item's own options"
        if self.multi_label:
            return "a multi-label task judges every label"
        if any(label.words for label in self.labels):
            return "a label with several words sums them all"
        return None

    def prunes(self, mode: str, exact: bool = False) -> bool:
        """Whether a run with `--prune mode` scores this task's labels pruned; never with --exact,
        whose re-scoring compares every label. "on" (the decision exact, the other probabilities
        computed with the labels left at their bounds) and "exact" (every probability within
        1e-4 too) prune; "auto", the default, scores every label, so that every probability is
        exact without a race that only pays with confident models (`bench` says whether either
        pays for a model and spec)."""
        return mode in PRUNING and not exact and self.pruning_refusal() is None

    def head_alone(self, prompt_scores: bool = False) -> bool:
        """Whether its head answers alone (no option scored): every question has a head of the
        state alone, and the options' scores were not asked for (scoring/reading.py)."""
        head = self.head
        if head is None or prompt_scores or any(r.reads.logprobs for r in head.readouts):
            return False
        return all(head.readout_for(q.id) is not None for q in self.questions) if self.questions else bool(head.readouts)

    def question_for(self, label: Label) -> str:
        """The multi-label question about one label."""
        return self.question.replace("{label}", label.name).replace("{description}", label.description or label.name)

    @property
    def lettered(self) -> bool:
        """The template shows the item's options as lettered lines through `{options}`."""
        return bool(self.choices) and OPTIONS_FIELD in self.template.fields

    def item_fields(self) -> tuple[str, ...]:
        """The template's fields an item must have (`{options}` is made from its choices)."""
        return tuple(f for f in self.template.fields if not (self.lettered and f == OPTIONS_FIELD))

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(label.name for label in self.labels)

    def check_record(self, record: Mapping[str, Any]) -> None:
        """Raise ValueError (a message to follow the item's id) if `record` cannot be scored."""
        fields = self.item_fields()
        for name in fields:
            if name not in record:
                raise ValueError(f"lacks field {name!r} used by the template")
            if is_missing(record[name]):
                raise ValueError(f"has no value in field {name!r} (used by the template): "
                                 f"{'null' if record[name] is None else 'a missing value'}")
            if isinstance(record[name], (bytes, bytearray)):
                raise ValueError(f"has bytes in field {name!r}, not text: decode them first")
            if isinstance(record[name], str) and not _encodable(record[name]):
                raise ValueError(f"has an unpaired surrogate (like \\ud800) in field {name!r}, which is not text")
        texts = [record[name] for name in fields if name != self.choices]
        if texts and all(isinstance(v, str) and not v.strip() for v in texts):
            raise ValueError(f"has nothing to classify: {'every field the template uses is' if len(texts) > 1 else f'its {fields[0]!r} is'} "
                             f"empty")
        options = choice_list(record, self.choices) if self.choices else None
        if options is not None and (self.lettered or self.score_by == "letter") and len(options) > len(LETTERS):
            raise ValueError(f"has {len(options)} options; lettered options go up to {len(LETTERS)}")
        for q in self.questions:
            if q.gold is not None:
                gold_value(record, q.gold)
                kind = pack_kind(q)
                if kind.option_of(q, record[q.gold]) is None:
                    raise ValueError(f"has gold {record[q.gold]!r} ({q.gold}) for question {q.id!r}, which is not one of its "
                                     f"answers ({', '.join(map(repr, kind.accepted(q)))})")
        if self.gold and self.multi_label:
            gold_tags(record, self.gold, self.label_names, self.gold_sep)
        elif self.gold:
            gold = gold_value(record, self.gold)
            allowed = options if options is not None else self.label_names
            if gold not in allowed and not (options is not None and option_of(gold, options) is not None):
                what = f"its '{self.choices}' (or their letters)" if options is not None else "the labels"
                raise ValueError(f"has gold {gold!r} ({self.gold}), which is not one of {what}")

    def system_text(self) -> str:
        """The system text with the label list substituted for `{labels}`, or appended."""
        if not self.labels:
            return self.system.strip()
        listing = "\n".join(
            f"- {lab.name}: {lab.description}" if lab.description else f"- {lab.name}"
            for lab in self.labels
        )
        if "{labels}" in self.system:
            return self.system.replace("{labels}", listing)
        head = self.system.rstrip()
        ask = (f"Answer {self.answers[0]} or {self.answers[1]} for each of these labels:" if self.multi_label
               else "Answer with exactly one of these labels:")
        block = f"{ask}\n{listing}"
        return f"{head}\n\n{block}" if head else block


OPTIONS_FIELD = "options"  # with `choices`, the template field that shows them lettered
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def lettered_options(options: list[str]) -> str:
    """'A. first\nB. second\n...', as multiple-choice exams show their options."""
    return "\n".join(f"{LETTERS[i]}. {text}" for i, text in enumerate(options))


def option_of(gold: str, options: list[str]) -> str | None:
    """The option a gold value names: the option itself, or its letter; None for neither."""
    if gold in options:
        return gold
    if len(gold) == 1 and gold in LETTERS[: len(options)]:
        return options[LETTERS.index(gold)]
    return None


def field_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False)


def choice_list(record: Mapping[str, Any], field: str) -> list[str]:
    """An item's options: a non-empty list of distinct, non-empty strings. Raises ValueError."""
    if field not in record:
        raise ValueError(f"lacks the options field {field!r}")
    value = record[field]
    if isinstance(value, str):  # CSV cells: a JSON list
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"field {field!r} must be a list of options (in CSV: a JSON list)")
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {field!r} must be a non-empty list of options")
    options = [field_text(v) if not isinstance(v, str) else v for v in value]
    if any(not o.strip() for o in options):
        raise ValueError(f"field {field!r} has an empty option")
    pair = twins(options)
    if pair is not None:
        raise ValueError(f"field {field!r} {twice('option', pair)}")
    return options


def gold_value(record: Mapping[str, Any], field: str) -> str:
    """The expected label or option text, as a string. Raises ValueError."""
    if field not in record or record[field] is None or record[field] == "":
        raise ValueError(f"lacks the gold field {field!r}")
    return field_text(record[field])


def gold_tags(record: Mapping[str, Any], field: str, labels: Sequence[str], sep: str = DEFAULT_GOLD_SEP
              ) -> list[str]:
    """A multi-label item's expected labels, in label order: a list, a JSON list, or a string
    of labels separated by `sep` (an empty string or list: no label applies). Raises ValueError."""
    if field not in record or record[field] is None:
        raise ValueError(f"lacks the gold field {field!r}")
    value = record[field]
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"has gold {value!r} ({field}), which is neither a JSON list nor labels separated by {sep!r}")
    if isinstance(value, str):
        value = [part.strip() for part in value.split(sep)] if value.strip() else []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"has gold {value!r} ({field}), which is not a list of labels "
                         f"(a JSON list, or labels separated by {sep!r})")
    unknown = [v for v in value if v not in labels]
    if unknown:
        raise ValueError(f"has gold label {unknown[0]!r} ({field}), which is not one of the labels")
    return [name for name in labels if name in value]
