"""The task spec: YAML in, a frozen, validated `TaskSpec` out. No torch here.

Validation happens before any model is loaded, so a typo costs the user a second, not a minute.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..errors import InputError, SpecError
from .decision import NORMALIZATIONS

FORMATS = ("auto", "chat", "plain")
ITEM_EXTENSIONS = (".jsonl", ".ndjson", ".csv", ".tsv", ".parquet")  # never a spec (a .json may be one)
DEFAULT_CONTENT_FREE = ("N/A", "", "[MASK]")

KNOWN_KEYS = (
    "model",
    "revision",
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
)
DEFAULT_QUESTION = "Is this about {label}?"
DEFAULT_ANSWERS = ("yes", "no")
DEFAULT_GOLD_SEP = ","
DEFAULT_ANSWER_PREFIX = "Answer:"  # the plain layout's line before the answer
PRUNE_AUTO = 10  # labels from which pruned label scoring is on by default, with examples (docs/performance.md)


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
    score_by: str = "text"  # multiple choice: score each option's "text" (cloze) or its "letter" (A, B, ...)
    multi_label: bool = False  # each label judged on its own by a yes/no question (tagging)
    question: str = DEFAULT_QUESTION  # multi-label: the question asked per label, with {label}
    answers: tuple[str, str] = DEFAULT_ANSWERS  # multi-label: the answers scored for on and off
    tag_thresholds: tuple[float, ...] = ()  # multi-label: the probability each label needs to be on
    gold_sep: str = DEFAULT_GOLD_SEP  # multi-label: what separates labels in a gold string
    digest: str | None = None  # sha256 of the spec file's bytes (None: not read from a file)

    def pruning_refusal(self) -> str | None:
        """Why pruned label scoring cannot apply to this task, or None."""
        if self.choices:
            return "multiple choice scores each item's own options"
        if self.multi_label:
            return "a multi-label task judges every label"
        if any(label.words for label in self.labels):
            return "a label with several words sums them all"
        return None

    def prunes(self, mode: str, exact: bool = False) -> bool:
        """Whether a run with `--prune mode` scores this task's labels pruned; never with --exact,
        whose re-scoring compares every label. "auto" prunes where it was measured to pay: a spec
        with examples and PRUNE_AUTO labels or more (the examples show the model its answers, so
        most labels fall out at their first token: 1.4x at 10 labels, 4.8x at 106). Without
        examples the model is unsure of every label's first token, the race scores nearly every
        label and its extra passes cost up to about 12% more than scoring them (at most 10% gained
        with 106 labels): "auto" does not prune, "on" does."""
        wanted = mode == "on" or (mode == "auto" and self.auto_prunes)
        return wanted and not exact and self.pruning_refusal() is None

    @property
    def auto_prunes(self) -> bool:
        """Whether `--prune auto` means pruning for this spec (when pruning applies at all)."""
        return bool(self.examples) and len(self.labels) >= PRUNE_AUTO

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
    if len(set(options)) != len(options):
        dup = next(o for o in options if options.count(o) > 1)
        raise ValueError(f"field {field!r} lists option {dup!r} twice")
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


def _calibration(value: Any, path: Path, choices: str | None) -> tuple[str, ...]:
    if value is None or value is False:
        return ()
    if choices is not None:
        raise SpecError(f"{path}: 'calibrate' applies to label tasks; for 'choices' use normalize: pmi")
    if value is True:
        return DEFAULT_CONTENT_FREE
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(f"{path}: 'calibrate' must be true, false or a list of content-free inputs like [\"N/A\", \"\"]")


def _threshold(value: Any, path: Path) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise SpecError(f"{path}: 'threshold' must be a probability in (0, 1], got {value!r}")
    return float(value)


def _score_by(data: Mapping, path: Path, choices: str | None) -> str:
    value = _want_str(data, "score_by", path, "text")
    if value not in ("text", "letter"):
        raise SpecError(f"{path}: 'score_by' must be text (score each option) or letter (score A, B, ...), got {value!r}")
    if value == "letter" and choices is None:
        raise SpecError(f"{path}: 'score_by: letter' is for multiple choice ('choices')")
    return value


def parse_template(text: str, where: str) -> Template:
    parts: list[tuple[str, str | None]] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise SpecError(f"{where}: invalid template {text!r}: {exc} (write {{{{ and }}}} for literal braces)")
    for literal, field, spec, conversion in parsed:
        if field is None:
            parts.append((literal, None))
            continue
        if field == "" or any(c in field for c in ".[]") or spec or conversion:
            raise SpecError(
                f"{where}: template field {{{field}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} is not allowed; use plain {{name}} references"
            )
        parts.append((literal, field))
    if not any(f for _, f in parts):
        raise SpecError(f"{where}: template {text!r} references no item field, e.g. {{text}}")
    return Template(text=text, parts=tuple(parts))


class _RefusedYAML(Exception):
    def __init__(self, mark: Any, message: str):
        super().__init__(message)
        self.line, self.message = (mark.line + 1 if mark else "?"), message


class _SpecLoader(yaml.SafeLoader):
    """yaml.safe_load, minus what a spec never needs and an attacker can use: aliases (a few lines
    of them expand to gigabytes) and keys given twice (the second silently wins)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _RefusedYAML(event.start_mark, f"YAML alias *{event.anchor} is not allowed in a spec; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _RefusedYAML(key_node.start_mark, f"key {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_text(path: Path, what: str) -> tuple[str, str]:
    """A file's text and the sha256 of its bytes (read once: the file may be a pipe)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(f"{path}: {what} file not found")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read {what}: {exc.strerror}")
    try:
        return data.decode("utf-8"), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start})")


def load_yaml(path: Path, what: str = "spec") -> Any:
    """A YAML file read as specs are (no aliases, no key given twice); `what` names it in errors."""
    return _parse_yaml(_read_text(path, what)[0], path)


def spec_text_data(raw: str, path: str | Path = "<spec>") -> Any:
    """What a spec's text holds, read exactly as `run` reads a spec file (SpecError otherwise)."""
    return _parse_yaml(raw, Path(path))


def _parse_yaml(raw: str, path: Path) -> Any:
    try:
        return yaml.load(raw, Loader=_SpecLoader)
    except _RefusedYAML as exc:
        raise SpecError(f"{path}:{exc.line}: {exc.message}")
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise SpecError(f"{loc}: YAML syntax error: {exc.problem or exc.context}")
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: YAML error: {exc}")
    except RecursionError:
        raise SpecError(f"{path}: YAML nested too deeply")


def _want_str(data: Mapping, key: str, path: Path, default: str | None = None) -> str | None:
    value = data.get(key, default)
    if isinstance(value, Mapping) and len(value) == 1 and next(iter(value.values())) is None:
        field = next(iter(value))  # `key: {field}` unquoted: YAML reads a mapping
        raise SpecError(f"{path}: '{key}' must be a string; YAML reads an unquoted {{{field}}} as a mapping: "
                        f"quote it: {key}: \"{{{field}}}\"")
    if value is not None and not isinstance(value, str):
        raise SpecError(f"{path}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _labels(value: Any, path: Path, choices: str | None) -> tuple[Label, ...]:
    if choices is not None:
        if value is not None:
            raise SpecError(f"{path}: give 'labels' or 'choices', not both")
        return ()
    if value is None:
        raise SpecError(f"{path}: 'labels' is required (a list of names, or a mapping of name to description)")
    if isinstance(value, Mapping):
        items = [(k, v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(k, None) for k in value]
    else:
        raise SpecError(f"{path}: 'labels' must be a list or a mapping, got {type(value).__name__}")
    if not items:
        raise SpecError(f"{path}: 'labels' is empty")
    labels, seen = [], set()
    for name, desc in items:
        if isinstance(name, bool):
            raise SpecError(f"{path}: label {name!r} is how YAML reads an unquoted yes/no/true/false/on/off; "
                            f"quote the label, e.g. \"yes\"")
        if isinstance(name, (int, float)):
            name = str(name)
        if not isinstance(name, str) or not name.strip():
            raise SpecError(f"{path}: label {name!r} must be a non-empty string")
        if name in seen:
            raise SpecError(f"{path}: label {name!r} is listed twice")
        words: tuple[str, ...] = ()
        if isinstance(desc, Mapping):
            desc, words = _label_entry(desc, name, path)
        if desc is not None and not isinstance(desc, str):
            raise SpecError(f"{path}: description of label {name!r} must be a string, or a mapping with "
                            f"'description' and 'words'")
        seen.add(name)
        label = Label(name, desc.strip() if desc else None, words)
        twin = next((other for other in labels if set(other.forms) == set(label.forms)), None)
        if twin is not None:  # the same words score the same: the second could never win
            raise SpecError(f"{path}: labels {twin.name!r} and {name!r} are scored by the same words "
                            f"({', '.join(map(repr, sorted(label.forms)))}), so {name!r} could never win: give each its own")
        labels.append(label)
    return tuple(labels)


def _label_entry(entry: Mapping, name: str, path: Path) -> tuple[Any, tuple[str, ...]]:
    """A label given as `{description: ..., words: [...]}`: its description and surface forms."""
    unknown = [k for k in entry if k not in ("description", "words")]
    if unknown:
        raise SpecError(f"{path}: label {name!r} has unknown key {unknown[0]!r} (it takes 'description' and 'words')")
    words = entry.get("words")
    if words is None:
        return entry.get("description"), ()
    if (not isinstance(words, list) or not words
            or not all(isinstance(w, str) and w.strip() for w in words)):
        raise SpecError(f"{path}: 'words' of label {name!r} must be a non-empty list of non-empty strings")
    if len(set(words)) != len(words):
        raise SpecError(f"{path}: 'words' of label {name!r} lists {next(w for w in words if words.count(w) > 1)!r} twice")
    return entry.get("description"), tuple(words)


def _examples(
    value: Any, path: Path, labels: tuple[Label, ...], template: Template, choices: str | None,
    multi_label: bool = False,
) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError(f"{path}: 'examples' must be a list of records")
    names = {lab.name for lab in labels}
    out = []
    for n, ex in enumerate(value, 1):
        if not isinstance(ex, Mapping):
            raise SpecError(f"{path}: example {n} must be a mapping with a '{'labels' if multi_label else 'label'}'")
        label = ex.get("label")
        if isinstance(label, (int, float)) and not isinstance(label, bool):
            label = str(label)
        if multi_label:
            label = _example_tags(ex, n, path, labels)
        elif choices is not None:
            try:
                options = choice_list(ex, choices)
            except ValueError as exc:
                raise SpecError(f"{path}: example {n}: {exc}")
            if option_of(str(label), options) is None:
                raise SpecError(f"{path}: example {n} has label {label!r}, which is not one of its '{choices}' "
                                f"(or their letters)")
        elif label not in names:
            raise SpecError(f"{path}: example {n} has label {label!r}, which is not one of the labels "
                            f"({', '.join(repr(lab.name) for lab in labels)})")
        lettered = choices is not None and OPTIONS_FIELD in template.fields
        missing = [f for f in template.fields if f not in ex and not (lettered and f == OPTIONS_FIELD)]
        if missing:
            raise SpecError(f"{path}: example {n} lacks field {missing[0]!r} used by the template")
        out.append({**ex, "label": label})
    return tuple(out)


def _example_tags(example: Mapping, n: int, path: Path, labels: tuple[Label, ...]) -> list[str]:
    """A multi-label example's labels: `labels:` (or `label:`) as a list, possibly empty."""
    key = "labels" if "labels" in example else "label"
    value = example.get(key)
    if isinstance(value, str):
        value = [value]
    names = [lab.name for lab in labels]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{path}: example {n} needs 'labels': a list of the labels that apply (may be empty)")
    unknown = [v for v in value if v not in names]
    if unknown:
        raise SpecError(f"{path}: example {n} has label {unknown[0]!r}, which is not one of the labels "
                        f"({', '.join(repr(name) for name in names)})")
    return [name for name in names if name in value]


def _tagging(data: Mapping, path: Path, choices: str | None, labels: tuple[Label, ...]) -> dict[str, Any]:
    """The multi-label keys: whether the task tags, its question, answers, per-label thresholds
    and gold separator. Refuses them on a task that picks one label."""
    multi = data.get("multi_label", False)
    if not isinstance(multi, bool):
        raise SpecError(f"{path}: 'multi_label' must be true or false")
    given = [k for k in ("question", "answers", "gold_sep") if k in data]
    if not multi:
        if given:
            raise SpecError(f"{path}: '{given[0]}' applies to multi_label tasks; add multi_label: true")
        if isinstance(data.get("threshold"), Mapping):
            raise SpecError(f"{path}: a 'threshold' per label applies to multi_label tasks; give one number")
        return {}
    if choices is not None:
        raise SpecError(f"{path}: 'multi_label' applies to label tasks, not to 'choices'")
    worded = next((lab.name for lab in labels if lab.words), None)
    if worded is not None:
        raise SpecError(f"{path}: label {worded!r} has 'words', which apply to tasks that pick one label; "
                        f"a multi_label task scores the 'answers' to its 'question'")
    question = _want_str(data, "question", path, DEFAULT_QUESTION)
    if "{label}" not in question and "{description}" not in question:
        raise SpecError(f"{path}: 'question' must name the label with {{label}} (or {{description}}), e.g. {DEFAULT_QUESTION!r}")
    answers = data.get("answers", list(DEFAULT_ANSWERS))
    if (not isinstance(answers, list) or len(answers) != 2 or not all(isinstance(a, str) and a.strip() for a in answers)
            or answers[0] == answers[1]):
        raise SpecError(f"{path}: 'answers' must be two different words, for on and off: [yes, no]")
    sep = _want_str(data, "gold_sep", path, DEFAULT_GOLD_SEP)
    if not sep:
        raise SpecError(f"{path}: 'gold_sep' must not be empty")
    return dict(multi_label=True, question=question, answers=tuple(answers), gold_sep=sep,
                tag_thresholds=_tag_thresholds(data.get("threshold"), path, labels))


def _tag_thresholds(value: Any, path: Path, labels: tuple[Label, ...]) -> tuple[float, ...]:
    """Each label's threshold: one number for all (default 0.5), or a mapping of label to number
    (labels it leaves out: 0.5)."""
    if value is None or not isinstance(value, Mapping):
        return (_threshold(value, path) or 0.5,) * len(labels)
    names = [lab.name for lab in labels]
    unknown = [k for k in value if k not in names]
    if unknown:
        raise SpecError(f"{path}: 'threshold' names {unknown[0]!r}, which is not one of the labels")
    return tuple(_threshold(value[name], path) if name in value else 0.5 for name in names)


def load_spec(path: str | Path, **keys: Any) -> TaskSpec:
    """Read and validate a task spec, with `keys` set over the file's. Raises `SpecError` naming
    the file and the key. The spec's `digest` is that of the bytes read (a spec from a pipe too)."""
    return read_spec_file(path).spec(**keys)


@dataclass(frozen=True)
class SpecFile:
    """A spec file as read, once (it may be a pipe): its text, its keys as YAML reads them (not
    validated yet) and the sha256 of its bytes."""

    path: Path
    text: str
    data: Mapping[str, Any]
    digest: str

    def spec(self, **keys: Any) -> TaskSpec:
        """The validated spec, with `keys` set over the file's."""
        return dataclasses.replace(spec_from_mapping({**self.data, **keys}, self.path), digest=self.digest)


def read_spec_file(path: str | Path) -> SpecFile:
    path = Path(path)
    suffix = Path(path.stem).suffix.lower() if path.suffix.lower() == ".gz" else path.suffix.lower()
    if suffix in ITEM_EXTENSIONS:
        raise SpecError(f"{path}: is an items file, not a spec; the spec comes first: prefixcache run SPEC ITEMS")
    raw, digest = _read_text(path, "spec")
    data = _parse_yaml(raw, path)
    if not isinstance(data, Mapping):
        raise SpecError(f"{path}: a spec is a YAML mapping of keys (model, system, labels, ...)")
    return SpecFile(path, raw, data, digest)


def spec_from_mapping(data: Mapping[str, Any], path: str | Path = "<spec>") -> TaskSpec:
    """Validate the keys of a spec given as a mapping (what a spec file holds); `path` names it in
    errors, and a relative model path is taken from its folder."""
    path = Path(path)
    for key in data:
        if key not in KNOWN_KEYS:
            hint = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(KNOWN_KEYS)}"
            raise SpecError(f"{path}: unknown key '{key}'{extra}")
    template = parse_template(_want_str(data, "template", path, "{text}"), f"{path}: 'template'")
    choices = _want_str(data, "choices", path)
    labels = _labels(data.get("labels"), path, choices)
    fmt = _want_str(data, "format", path, "auto")
    if fmt not in FORMATS:
        raise SpecError(f"{path}: 'format' must be one of {', '.join(FORMATS)}, got {fmt!r}")
    norm = _want_str(data, "normalize", path, "sum")
    if norm not in NORMALIZATIONS:
        raise SpecError(f"{path}: 'normalize' must be one of {', '.join(NORMALIZATIONS)}, got {norm!r}")
    trust = data.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise SpecError(f"{path}: 'trust_remote_code' must be true or false")
    id_field = _want_str(data, "id_field", path, "id")
    if not id_field:
        raise SpecError(f"{path}: 'id_field' must not be empty")
    if data.get("model") == "":
        raise SpecError(f"{path}: 'model' is empty; leave it out for the embedded default model, or name one "
                        f"(a hub id, a folder or a .gguf file)")
    tagging = _tagging(data, path, choices, labels)
    if tagging and norm != "sum":
        raise SpecError(f"{path}: a multi_label task compares two answers to the same question: normalize "
                        f"must be sum (use calibrate for the label prior); got {norm!r}")
    return TaskSpec(
        path=str(path),
        model=_want_str(data, "model", path),
        system=_want_str(data, "system", path, "") or "",
        labels=labels,
        examples=_examples(data.get("examples"), path, labels, template, choices, bool(tagging)),
        template=template,
        id_field=id_field,
        id_field_given="id_field" in data,
        format=fmt,
        normalize=norm,
        answer_prefix=_want_str(data, "answer_prefix", path, DEFAULT_ANSWER_PREFIX),
        trust_remote_code=trust,
        choices=choices,
        gold=_want_str(data, "gold", path),
        content_free=_calibration(data.get("calibrate"), path, choices),
        threshold=None if tagging else _threshold(data.get("threshold"), path),
        revision=_want_str(data, "revision", path),
        score_by=_score_by(data, path, choices),
        **tagging,
    )
