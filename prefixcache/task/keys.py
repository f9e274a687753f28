"""The spec's keys, each read into its typed value and checked (labels, examples, tagging,
calibration, threshold, template), and `spec_from_mapping`, which builds the `TaskSpec` from them.
No torch here."""

from __future__ import annotations

import difflib
import string
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, overload


from ..errors import SpecError
from .decision import NORMALIZATIONS
from .head import Head, load_head
from .texts import text_key, twice, twins
from .kind import pack_kind
from .questions import Question, content_free_value, label_kind, parse_pack, threshold_value
from .spec import (
    DEFAULT_ANSWER_PREFIX,
    DEFAULT_ANSWERS,
    DEFAULT_GOLD_SEP,
    DEFAULT_QUESTION,
    FORMATS,
    KNOWN_KEYS,
    OPTIONS_FIELD,
    Label,
    TaskSpec,
    Template,
    choice_list,
    option_of,
)

def _calibration(value: Any, path: Path, choices: str | None) -> tuple[str, ...]:
    if choices is not None and value not in (None, False):
        raise SpecError(f"{path}: 'calibrate' applies to label tasks; for 'choices' use normalize: pmi")
    return content_free_value(value, str(path))


def _threshold(value: Any, path: Path) -> float | None:
    return threshold_value(value, str(path))


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


@overload
def _want_str(data: Mapping[str, Any], key: str, path: Path, default: str) -> str: ...
@overload
def _want_str(data: Mapping[str, Any], key: str, path: Path, default: None = None) -> str | None: ...
def _want_str(data: Mapping[str, Any], key: str, path: Path, default: str | None = None) -> str | None:
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
    labels: list[Label] = []
    seen: dict[str, str] = {}
    for name, desc in items:
        if isinstance(name, bool):
            raise SpecError(f"{path}: label {name!r} is how YAML reads an unquoted yes/no/true/false/on/off; "
                            f"quote the label, e.g. \"yes\"")
        if isinstance(name, (int, float)):
            name = str(name)
        if not isinstance(name, str) or not name.strip():
            raise SpecError(f"{path}: label {name!r} must be a non-empty string")
        first = seen.get(text_key(name))
        if first == name:
            raise SpecError(f"{path}: label {name!r} is listed twice")
        if first is not None:
            raise SpecError(f"{path}: {twice('label', (first, name))}")
        words: tuple[str, ...] = ()
        if isinstance(desc, Mapping):
            desc, words = _label_entry(desc, name, path)
        if desc is not None and not isinstance(desc, str):
            raise SpecError(f"{path}: description of label {name!r} must be a string, or a mapping with "
                            f"'description' and 'words'")
        seen[text_key(name)] = name
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
    pair = twins(words)
    if pair is not None:
        raise SpecError(f"{path}: 'words' of label {name!r} {twice('', pair)}")
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
    return tuple((_threshold(value[name], path) or 0.5) if name in value else 0.5 for name in names)


def _known_keys(data: Mapping[str, Any], path: Path) -> None:
    """Refuse a key no spec has, naming the closest known one."""
    for key in data:
        if key not in KNOWN_KEYS:
            hint = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(KNOWN_KEYS)}"
            raise SpecError(f"{path}: unknown key '{key}'{extra}")


def spec_from_mapping(data: Mapping[str, Any], path: str | Path = "<spec>") -> TaskSpec:
    """Validate the keys of a spec given as a mapping (what a spec file holds); `path` names it in
    errors, and a relative model path is taken from its folder."""
    path = Path(path)
    _known_keys(data, path)
    template = parse_template(_want_str(data, "template", path, "{text}"), f"{path}: 'template'")
    choices = _want_str(data, "choices", path)
    labels = () if "questions" in data else _labels(data.get("labels"), path, choices)
    fmt = _one_of(data, "format", path, "auto", FORMATS)
    norm = _one_of(data, "normalize", path, "sum", NORMALIZATIONS)
    trust = data.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise SpecError(f"{path}: 'trust_remote_code' must be true or false")
    id_field = _want_str(data, "id_field", path, "id")
    if not id_field:
        raise SpecError(f"{path}: 'id_field' must not be empty")
    if data.get("model") == "":
        raise SpecError(f"{path}: 'model' is empty; leave it out for the embedded default model, or name one "
                        f"(a hub id, a folder or a .gguf file)")
    head = _head(data, path, choices)
    if "questions" in data:
        return _with_head(replace(_question_spec(data, path, template, fmt, norm, trust, id_field), head=head))
    tagging = _tagging(data, path, choices, labels)
    if tagging and norm != "sum":
        raise SpecError(f"{path}: a multi_label task compares two answers to the same question: normalize "
                        f"must be sum (use calibrate for the label prior); got {norm!r}")
    return _with_head(TaskSpec(
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
        backend=_backend(data, path),
        score_by=_score_by(data, path, choices),
        head=head,
        **tagging,
    ))


def _with_head(spec: TaskSpec) -> TaskSpec:
    """The spec, its head's header checked against its questions (before any model loads)."""
    if spec.head is not None:
        spec.head.check_questions(spec.questions or [label_kind(spec).question(spec, spec.label_names)])
    return spec


def _one_of(data: Mapping[str, Any], key: str, path: Path, default: str, allowed: tuple[str, ...]) -> str:
    value = _want_str(data, key, path, default)
    if value not in allowed:
        raise SpecError(f"{path}: '{key}' must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _head(data: Mapping[str, Any], path: Path, choices: str | None) -> Head | None:
    """The fitted readout a spec names, read and checked (before any model loads)."""
    if "head" in data and data["head"] is None:
        raise SpecError(f"{path}: 'head' is empty: name the head file prefixcache fit wrote, or remove the key "
                        f"(the prompt then answers)")
    if data.get("head") is None:
        return None
    if choices is not None:
        raise SpecError(f"{path}: 'head' cannot be used with 'choices': each item has its own options, and a head "
                        f"is fitted on one set of answers")
    return load_head(data["head"], path)


QUESTION_REFUSED = ("labels", "choices", "multi_label", "question", "answers", "gold_sep", "score_by", "gold", "threshold")


def _question_spec(data: Mapping[str, Any], path: Path, template: Template, fmt: str, norm: str, trust: bool,
                   id_field: str) -> TaskSpec:
    """A spec of typed questions: the top-level keys that ask one question are refused (each
    question has its own gold and threshold); `normalize` and `calibrate` are every question's default."""
    given = next((k for k in QUESTION_REFUSED if k in data), None)
    if given is not None:
        where = "each question takes its own" if given in ("gold", "threshold") else "a spec asks 'questions' or one question"
        raise SpecError(f"{path}: '{given}' cannot be given with 'questions' ({where})")
    questions = parse_pack(data["questions"], str(path), norm, data.get("calibrate"))
    return TaskSpec(
        path=str(path), model=_want_str(data, "model", path), system=_want_str(data, "system", path, "") or "",
        labels=(), examples=_question_examples(data.get("examples"), path, questions, template), template=template,
        id_field=id_field, id_field_given="id_field" in data, format=fmt, normalize=norm,
        answer_prefix=_want_str(data, "answer_prefix", path, DEFAULT_ANSWER_PREFIX), trust_remote_code=trust,
        revision=_want_str(data, "revision", path), backend=_backend(data, path), questions=questions,
    )


def _backend(data: Mapping[str, Any], path: Path) -> str | None:
    """The spec's `backend`: what runs its model (a name; the engines there are check it before
    any model loads: scoring/prepare.py)."""
    return _want_str(data, "backend", path)


def _question_examples(value: Any, path: Path, questions: tuple[Question, ...], template: Template) -> tuple[dict, ...]:
    """Examples of a question spec: the template's fields and `answers`, question id -> answer
    (any subset), stored as question id -> option."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError(f"{path}: 'examples' must be a list of records")
    by_id = {q.id: q for q in questions}
    out = []
    for n, ex in enumerate(value, 1):
        if not isinstance(ex, Mapping) or not isinstance(ex.get("answers"), Mapping) or not ex["answers"]:
            raise SpecError(f"{path}: example {n} needs 'answers': question id -> answer, e.g. {{{questions[0].id}: ...}}")
        missing = [f for f in template.fields if f not in ex]
        if missing:
            raise SpecError(f"{path}: example {n} lacks field {missing[0]!r} used by the template")
        answers = {}
        for qid, given in ex["answers"].items():
            q = by_id.get(str(qid))
            if q is None:
                raise SpecError(f"{path}: example {n} answers {qid!r}, which is not one of the questions "
                                f"({', '.join(map(repr, by_id))})")
            option = pack_kind(q).option_of(q, given)
            if option is None:
                raise SpecError(f"{path}: example {n} answers {q.id!r} with {given!r}, which is not one of its "
                                f"answers ({', '.join(map(repr, pack_kind(q).accepted(q)))})")
            answers[q.id] = option
        out.append({**ex, "answers": answers})
    return tuple(out)
