"""A spec with what the command line, `Classifier` or the environment sets instead of its own
keys (`--gold`, `--gold-sep`, `-m`, `--revision`), checked as the spec's own keys are."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from ..errors import SpecError
from .spec import TaskSpec


def with_overrides(spec: TaskSpec, gold: Optional[str] = None, model: Optional[str] = None,
                   revision: Optional[str] = None, gold_sep: Optional[str] = None) -> TaskSpec:
    """The spec with what the command line (or environment) sets instead. A model given there is
    a path relative to the current folder, not the spec's. `gold=""`: no gold field at all (a
    spec with one, run on unlabelled items)."""
    if gold == "":
        spec = dataclasses.replace(spec, gold=None, questions=tuple(dataclasses.replace(q, gold=None)
                                                                     for q in spec.questions))
    elif gold and spec.questions:
        spec = dataclasses.replace(spec, questions=_question_golds(spec, gold))
    elif gold:
        if "=" in gold and not any(gold == f for f in spec.template.fields):
            raise SpecError(f"--gold {gold}: naming a question applies to specs with 'questions'; give the item field")
        spec = dataclasses.replace(spec, gold=gold)
    if gold_sep is not None:
        if not spec.multi_label:
            raise SpecError(f"{spec.path}: --gold-sep applies to multi_label tasks")
        if not gold_sep:
            raise SpecError("--gold-sep must not be empty")
        spec = dataclasses.replace(spec, gold_sep=gold_sep)
    if model:
        spec = dataclasses.replace(spec, model=str(Path(model).expanduser().absolute()) if Path(model).exists() else model)
    if revision:
        spec = dataclasses.replace(spec, revision=revision)
    if spec.multi_label and spec.gold:
        holding = [name for name in spec.label_names if spec.gold_sep in name]
        if holding:
            raise SpecError(f"{spec.path}: label {holding[0]!r} holds the gold separator {spec.gold_sep!r}, so no gold "
                            f"value could name it: choose another separator (gold_sep, --gold-sep)")
    return spec


def _question_golds(spec: TaskSpec, given: str) -> tuple:
    """The questions with `--gold QUESTION=FIELD,...` set (the others keep their spec's 'gold')."""
    fields: dict[str, str] = {}
    for part in given.split(","):
        qid, sep, field = part.partition("=")
        if not sep or not qid.strip() or not field.strip():
            raise SpecError(f"--gold {given}: a spec with 'questions' takes QUESTION=FIELD pairs separated by commas, "
                            f"e.g. {spec.questions[0].id}=expected_{spec.questions[0].id}")
        if qid.strip() not in {q.id for q in spec.questions}:
            raise SpecError(f"--gold names {qid.strip()!r}, which is not one of the questions "
                            f"({', '.join(repr(q.id) for q in spec.questions)})")
        fields[qid.strip()] = field.strip()
    return tuple(dataclasses.replace(q, gold=fields[q.id]) if q.id in fields else q for q in spec.questions)
