"""The prompt variants `tune` compares: the spec as written, alternatives named in a variants
file, and every combination of the system prompts (`--system`) and example sets (`--examples`)
given, each with every model (`-m`). Each is a spec validated as any spec is, before a model
loads. No torch.

A variants file is a YAML list (or a mapping with `variants:`) of the spec keys each variant sets:

    - name: terse
      system: You route support tickets. Reply with the category only.
    - name: no examples
      examples: []
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import SpecError
from ..task.overrides import with_overrides
from ..task.keys import spec_from_mapping
from ..task.spec import TaskSpec
from ..task.specfile import load_yaml, SpecFile

# What a variant may set: the prompt and the model. The decision keys are what tune searches, and
# the rest say what an item and its gold value are, which every variant must share.
VARIANT_KEYS = ("system", "examples", "template", "format", "answer_prefix", "labels", "question", "answers",
                "score_by", "model", "revision")
SEARCHED_KEYS = ("normalize", "calibrate", "threshold")
AS_WRITTEN = "as written"  # the spec's own prompt


@dataclass(frozen=True)
class Variant:
    """One prompt (and model) to score the labelled items with."""

    name: str  # as the leaderboard shows it: "as written", "system 2 + examples 1", a variants-file name
    keys: Mapping[str, Any]  # the spec keys it sets over the spec file's (model: as given)
    spec: TaskSpec  # validated, with the command line's overrides

    @property
    def is_spec(self) -> bool:
        """The spec as written (with its own model)."""
        return not self.keys


def variants(spec_file: SpecFile, base: TaskSpec, variants_file: Path | None = None, systems: Sequence[str] = (),
             examples: Sequence[Path] = (), models: Sequence[str] = (), gold_sep: str | None = None) -> list[Variant]:
    """Every variant to score: the prompts (the spec's; each of the variants file; each
    combination of the spec's and the given system prompts and example sets), each with the
    spec's model and every model of `models`. `base` is the spec with the command line's
    overrides (--gold, --revision). Raises SpecError naming the file and the variant."""
    spec_path, raw = spec_file.path, spec_file.data
    prompts: list[tuple[str, dict[str, Any]]] = [(AS_WRITTEN, {})]
    if variants_file is not None:
        prompts += _from_file(variants_file)
    system_texts = [(f"system {n}", {"system": _system_text(text)}) for n, text in enumerate(systems, 1)]
    example_sets = [(f"examples {n}", {"examples": _example_set(path)}) for n, path in enumerate(examples, 1)]
    for sys_name, sys_keys in [("", {})] + system_texts:
        for ex_name, ex_keys in [("", {})] + example_sets:
            if sys_keys or ex_keys:
                prompts.append((" + ".join(n for n in (sys_name, ex_name) if n), {**sys_keys, **ex_keys}))
    found: list[Variant] = []
    for model in [None, *dict.fromkeys(models)]:
        for name, keys in prompts:
            keys = dict(keys, model=model) if model is not None else keys
            if model is not None:
                name = f"{name} · {_short(model)}"
            found.append(_variant(spec_path, raw, base, name, keys, gold_sep))
    return _distinct(found)


def _variant(spec_path: Path, raw: Mapping[str, Any], base: TaskSpec, name: str, keys: Mapping[str, Any],
             gold_sep: str | None) -> Variant:
    """A variant's spec: the file's keys with the variant's set over them, validated, with the
    command line's overrides; it must judge the same labels as the spec."""
    model = keys.get("model")
    own = {k: v for k, v in keys.items() if k != "model"}
    try:
        spec = spec_from_mapping({**raw, **own}, spec_path)
    except SpecError as exc:
        raise SpecError(f"variant {name!r}: {exc}") from None
    spec = with_overrides(spec, base.gold, model, base.revision if model is None else None, gold_sep)
    if spec.label_names != base.label_names:
        raise SpecError(f"variant {name!r}: its labels {list(spec.label_names)} are not the spec's "
                        f"{list(base.label_names)}; a variant may reword them (description, words), not rename them")
    return Variant(name, dict(keys), spec)


def _from_file(path: Path) -> list[tuple[str, dict[str, Any]]]:
    data = load_yaml(path, "variants file")
    if isinstance(data, Mapping) and "variants" in data:
        data = data["variants"]
    if not isinstance(data, list) or not data:
        raise SpecError(f"{path}: a variants file is a list of the spec keys each variant sets, e.g. "
                        f"- {{name: terse, system: ...}}")
    out: list[tuple[str, dict[str, Any]]] = []
    for n, entry in enumerate(data, 1):
        if not isinstance(entry, Mapping):
            raise SpecError(f"{path}: variant {n} must be a mapping of spec keys")
        name = entry.get("name", f"variant {n}")
        keys = {k: v for k, v in entry.items() if k != "name"}
        for key in keys:
            if key in SEARCHED_KEYS:
                raise SpecError(f"{path}: variant {n} sets {key!r}, which tune searches itself; leave it out")
            if key not in VARIANT_KEYS:
                raise SpecError(f"{path}: variant {n} sets {key!r}; a variant sets the prompt or the model: "
                                f"{', '.join(VARIANT_KEYS)}")
        if not keys:
            raise SpecError(f"{path}: variant {n} sets no key")
        if not isinstance(name, str) or not name.strip():
            raise SpecError(f"{path}: variant {n}: 'name' must be a non-empty string")
        if any(name.strip() == other for other, _ in out):
            raise SpecError(f"{path}: variant {n} is named {name.strip()!r} like another; give each its own name")
        out.append((name.strip(), keys))
    return out


def _system_text(text: str) -> str:
    """--system TEXT, or @FILE for the text of a file."""
    if not text.startswith("@"):
        return text
    path = Path(text[1:])
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"--system {text}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}")


def _example_set(path: Path) -> list[Any]:
    """--examples FILE: a YAML or JSON list of examples (or a spec-like mapping with `examples:`),
    or JSON lines, one example a line."""
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"--examples {path}: cannot read: {getattr(exc, 'strerror', None) or exc}")
        try:
            return [json.loads(line) for line in lines if line.strip()]
        except json.JSONDecodeError as exc:
            raise SpecError(f"--examples {path}: not JSON lines: {exc}")
    data = load_yaml(path, "examples file")
    if isinstance(data, Mapping) and "examples" in data:
        data = data["examples"]
    if not isinstance(data, list):
        raise SpecError(f"--examples {path}: must hold a list of examples (or a mapping with 'examples:')")
    return data


def _short(model: str) -> str:
    """A model's name as a column shows it: the last part of a path or hub id."""
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def _distinct(found: list[Variant]) -> list[Variant]:
    """Variants that score different prompts or models (the first of equal ones is kept)."""
    seen: set[tuple] = set()
    out = []
    for variant in found:
        s = variant.spec
        key = (s.model, s.revision, s.system, s.examples and json.dumps(s.examples, sort_keys=True, default=str),
               s.template.text, s.format, s.answer_prefix, s.labels, s.question, s.answers, s.score_by)
        if key not in seen:
            seen.add(key)
            out.append(variant)
    return out
