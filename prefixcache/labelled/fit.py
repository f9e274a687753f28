"""One `prefixcache fit`, end to end: `fit(FitOptions)` gives a `FitResult`.

Every check that needs no model comes first (the spec, its gold fields, the labelled items, the
files to write); then the labelled items are scored once in `run`'s batches, the final hidden
state at each question's answer position read from the same forward (labelled/passes.py), and each
question's readout is judged against the prompt rule on held-out folds and fitted on every item
(labelled/heads.py). It writes the head file, the fitted spec (the spec with `head:` set) and the
figures as JSON. It never prints: progress goes through `step`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import safefile
from ..data.items import Item, text_digest
from ..data.output import check_distinct
from ..data.records import id_text
from ..errors import InputError, SpecError, UsageError
from ..run.options import RunOptions
from ..run.plan import check_reads_states, load_options_spec
from ..reports.resampling import Figure
from ..scoring.prepare import Batching
from ..model.engines import default_backend
from ..scoring.reading import precision_of
from ..task.head import Head, Readout, head_bytes
from ..task.kind import Question, pack_kind
from ..task.questions import label_kind
from ..task.spec import TaskSpec, field_text, gold_tags, gold_value
from ..task.specfile import SpecFile, read_spec_file
from .cutpoint import ABSTAIN_ALL, Cut
from ..task.features import Features, candidates, views_of
from .data import Labelled
from .heads import Asked, Judged, judge
from .suggest import PICKED_BY, RANDOM
from ..run.labelled import labelled_items
from ..task.tuned import check_tuned_output, relocated, write_tuned

log = logging.getLogger("prefixcache")
MIN_ITEMS = 2  # a head needs two items (of two answers); under SMALL, fit says its figures are rough
LAYER = "final"  # the state after the last norm: what the lm_head reads (docs/fit.md says why)
Step = Callable[[str, int, int], None]


@dataclass(frozen=True)
class FitOptions:
    """What a fit takes. `run` carries the spec, the labelled items and how they are read, --gold,
    the model, device and batches; `output` is the fitted spec (the head and figures go beside it)."""

    run: RunOptions
    output: Path
    folds: int = 5
    seed: int = 0
    figures: Optional[Path] = None  # the JSON figures (default: OUTPUT with .fit.json)
    overwrite: bool = False
    asked: Optional[Asked] = None  # a cut-point to choose (--target-accuracy, --coverage, --confidence)
    features: str = "state"  # state: views of the forward alone, chosen (heads that answer alone at run time);
    # auto: the options' log-probs may be chosen too (every option of every item scored); or one feature set
    prompt_sample: Optional[int] = None  # items the prompt alone is measured on (None: by cost, see passes.py)
    more: tuple[str, ...] = ()  # further labelled files, read after `run.items` as one (an id at most once)

    @property
    def head_path(self) -> Path:
        return self.output.with_name(self.output.stem + ".head.safetensors")

    @property
    def figures_path(self) -> Path:
        return self.figures or self.output.with_name(self.output.stem + ".fit.json")


@dataclass(frozen=True)
class FitPlan:
    spec: TaskSpec
    spec_file: SpecFile
    items: list[Item]
    questions: tuple[Question, ...]  # the questions fitted: those with gold values
    before: Optional[np.ndarray] = None  # [N] bool: the items the last fit of this head had (None: none known)


@dataclass
class FitResult:
    options: FitOptions
    plan: FitPlan
    judged: list[Judged]
    read: Any  # the pass's own account (passes.States): its cost, rows read back, the prompt's sample
    engine: str  # what read the states (the fitted spec asks for the same)
    precision: str  # what that engine computed in (the head keeps both)
    written: list[Path] = field(default_factory=list)

    @property
    def ms_per_item(self) -> float:
        return self.read.ms_per_item

    @property
    def kept(self) -> int:
        """Items whose states were read back from an earlier fit of the same task."""
        return self.read.kept

    def to_json(self) -> dict[str, Any]:
        return {"spec": str(self.options.run.spec), "labelled": [self.options.run.items, *self.options.more],
                "items": len(self.plan.items), "folds": self.options.folds, "seed": self.options.seed,
                "layer": LAYER, "ms_per_item": round(self.ms_per_item, 3), "states_read_back": self.kept,
                "rows_forwarded": self.read.forwards, "prompt_scored_items": int(self.read.scored.sum()),
                "prompt_ms_per_item": round(self.read.prompt_ms_per_item, 3),
                "questions": [j.to_json() for j in self.judged],
                "written": [str(p) for p in self.written]}


def plan_fit(options: FitOptions) -> FitPlan:
    """Every check that needs no model: a mistake costs a second, not a model load."""
    o = options.run
    if options.folds < 2:
        raise UsageError("--folds must be 2 or more")
    spec_file = read_spec_file(o.spec)
    spec = load_options_spec(o, spec_file)
    questions = fitted_questions(spec)
    check_reads_states(spec, o, "fit")
    for path in (options.output, options.head_path, options.figures_path):
        check_tuned_output(path, o.spec, options.overwrite)
    files = (o.items, *options.more)
    check_distinct({"-o": options.output, "head": options.head_path, "--json": options.figures_path},
                   {f"LABELLED {path}": path for path in files})
    items = all_labelled(files, o, spec)
    if len(items) < MIN_ITEMS:
        raise UsageError(f"{o.items}: {len(items)} labelled item{'s are' if len(items) != 1 else ' is'} too few to fit "
                         f"a head and measure it held out; fit needs at least {MIN_ITEMS}")
    check_gold_kinds(spec, questions, items)
    return FitPlan(replace(spec, head=None), spec_file, items, questions, last_fit(spec, options, items))


def check_gold_kinds(spec: TaskSpec, questions: Sequence[Question], items: Sequence[Item]) -> None:
    """Refuse, before any model reads an item, a question whose labelled items all give one answer
    (or, for tags, none on): no head can be fitted on them (heads.py refuses it again, later)."""
    for q in questions:
        if q.kind.judged_each:
            if not any(gold_tags(item.record, q.gold_field, q.options, spec.gold_sep) for item in items):
                raise UsageError(f"{q.id}: no labelled item has any label on: a head needs items of each kind")
            continue
        present = {_option(q, spec, item) for item in items}
        if len(present) < 2:
            raise UsageError(f"{q.id}: every labelled item has the gold {next(iter(present))!r}: a head needs items of "
                             f"two options or more")


def folds_for(items: int, folds: int) -> int:
    """The folds a fit of `items` labelled items uses: those asked, at most one an item."""
    return min(folds, items)


SMALL = 10  # labelled items under which fit says its held-out figures are rough


def all_labelled(files: Sequence[str], o: RunOptions, spec: TaskSpec) -> list[Item]:
    """The labelled items of every file, in order, each checked; an id in two files is refused."""
    items: list[Item] = []
    seen: dict[str, str] = {}
    for path in files:
        for item in labelled_items(path, replace(o, limit=None), [spec], "fit reads its labelled items from a file"):
            key = id_text(item.id)
            if key in seen:
                raise InputError(f"{path}: item {key} is labelled in {seen[key]} too; keep one of them")
            seen[key] = path
            items.append(item)
    return items[:o.limit] if o.limit else items


def last_fit(spec: TaskSpec, options: FitOptions, items: Sequence[Item]) -> Optional[np.ndarray]:
    """Which of `items` the last fit had (by id or text): that of the head file about to be
    replaced, else of the spec's own head (a fitted spec fitted again); None when neither says."""
    from ..task.head import load_head

    found = None
    if options.head_path.is_file():
        try:
            found = load_head(str(options.head_path.resolve()), options.output).fitted.get("labelled")
        except SpecError:
            found = None
    if not isinstance(found, dict) and spec.head is not None:
        found = spec.head.fitted.get("labelled")
    if not isinstance(found, dict):
        return None
    ids, texts, fields = set(found.get("ids", ())), set(found.get("texts", ())), spec.item_fields()
    return np.array([id_text(i.id) in ids or text_digest(i.record, fields) in texts for i in items], dtype=bool)


def fit(options: FitOptions, step: Step = lambda what, done, total: None, plan: Optional[FitPlan] = None) -> FitResult:
    """Plan, read the items' states, judge and fit each question's readout, write the files."""
    from .passes import fit_scorer  # torch: once the checks have passed

    plan = plan or plan_fit(options)
    o = options.run
    scorer = fit_scorer(plan.spec, o.scoring(), step, plan.items)
    fitted = fit_heads(scorer, plan.items, plan.questions, Batching(o.batch_size, o.batch_tokens), options.folds,
                       options.seed, step, options.asked, options.features, plan.before, options.prompt_sample)
    result = FitResult(options, plan, fitted.judged, fitted.read, engine=scorer.engine.name,
                       precision=precision_of(scorer.engine))
    _write(result, fitted.readouts, fitted.read.fingerprint)
    return result


@dataclass
class Fitted:
    """Each question's judgement and readout, and the pass that read the states (passes.States:
    the task's fingerprint, what it cost, which items had their options scored)."""

    judged: list[Judged]
    readouts: list[Readout]
    read: Any

    def head(self, path: str = "<fitted in Python>") -> Head:
        """The readouts as the head a spec holds (what the head file, read back, gives)."""
        return Head(path, tuple(self.readouts), self.read.fingerprint, LAYER, "", {})


def feature_sets(features: str, layers: int) -> tuple[str, ...]:
    """The feature sets fit chooses among (`FitOptions.features`) on an engine that reads
    `layers` decoder layers (0: the final state alone). Raises UsageError for one it cannot read."""
    if features in ("state", "auto"):
        return tuple(f.name for f in candidates(layers, logprobs=features == "auto"))
    try:
        f = Features.parse(features)
    except ValueError as exc:
        raise UsageError(f"--features: {exc}; or state, or auto") from None
    if f.deepest > layers or (f.beyond_final and not layers):
        raise UsageError(f"--features {features}: this model's engine reads " + (
            f"{layers} layers" if layers else "the final state at the answer position alone"))
    return (f.name,)


def fit_heads(scorer: Any, items: Sequence[Item], questions: Sequence[Question], batching: Batching, folds: int,
              seed: int, step: Step = lambda what, done, total: None, asked: Optional[Asked] = None,
              features: str = "state", before: Optional[np.ndarray] = None, prompt: Optional[int] = None) -> Fitted:
    """Read the labelled items' views with `scorer` (its spec without a head) and the options'
    scores where needed, then judge and fit a readout for each question (`before`: the items the
    last fit had, see `heads.judge`; `prompt`: the items the prompt alone is measured on)."""
    from .passes import read_states  # torch

    spec = scorer.task.spec
    sets = feature_sets(features, scorer.engine.layers)
    if any(Features.parse(f).logprobs for f in sets):
        prompt = len(items)  # the options' scores are features: every item's
    read = read_states(scorer, items, questions, batching, views_of([Features.parse(f) for f in sets]), prompt,
                       seed, step)
    judged, readouts = [], []
    for q, (states, logprobs, decisions) in zip(questions, read.per_question):
        data = labelled(q, spec, items, states, logprobs, decisions, read.scored)
        what = f"judging {q.id}: {folds}-fold cross-validation, then the head on every item"
        step(what, 0, 0)
        cuts = asked if q.kind.abstains else None
        j, r = judge(data, folds_for(len(items), folds), seed, lambda done, total: step(what, done, total), cuts, sets,
                     before)
        if len(items) < SMALL:
            j.notes.append(f"{len(items)} labelled items: the head is fitted, and its held-out figures (each item "
                           f"predicted by a head fitted without it) are rough; label more to know how good it is")
        if asked is not None and cuts is None:
            j.notes.append(f"no cut chosen: a {q.kind.name} question's answer is never abstained" + (
                " (each tag has its own threshold, chosen for F1)" if data.binary else " (it is a probability or score)"))
        judged.append(j)
        readouts.append(r)
    return Fitted(judged, readouts, read)




def cut_keys(plan: FitPlan, judged: Sequence[Judged]) -> dict[str, Any]:
    """The spec keys that make `run` abstain below each chosen cut: a label spec's `threshold`, a
    pack's questions each with its own (the pack written whole, with the others as they were)."""
    cuts = {j.qid: round(j.cut.chosen.cut, 6) if j.cut.chosen is not None else ABSTAIN_ALL
            for j in judged if j.cut is not None and (j.cut.chosen is not None or j.cut.per_option)
            and not answers_all(j.cut)}
    if not cuts:
        return {}
    if not plan.spec.questions:
        return {"threshold": next(iter(cuts.values()))}
    pack = copy.deepcopy(plan.spec_file.data["questions"])
    for qid, cut in cuts.items():
        pack[qid]["threshold"] = cut
    return {"questions": pack}


def answers_all(cut: Cut) -> bool:
    """The cut chosen answers every held-out item (`--coverage 1`, or a target met at full
    coverage): no threshold, since one at the least confident held-out item would make new
    items below it abstain."""
    return cut.chosen is not None and cut.chosen.answered == cut.chosen.total and not cut.per_option


def fitted_questions(spec: TaskSpec) -> tuple[Question, ...]:
    """The questions a head can be fitted for: a label spec's one (with a gold field), a pack's
    questions with gold; refuses multiple choice, whose options differ per item."""
    if spec.choices:
        raise SpecError(f"{spec.path}: fit trains a head on one set of answers, and with 'choices' each item has its "
                        f"own options; fit a spec with labels or typed questions")
    questions = tuple(q for q in spec.questions if q.gold) if spec.questions else (
        (label_kind(spec).question(spec, spec.label_names),) if spec.gold else ())
    if not questions:
        raise SpecError("fit learns from gold values: name the field with --gold FIELD (or 'gold' in the spec; "
                        "for typed questions, a question's 'gold' or --gold QUESTION=FIELD)")
    if importlib.util.find_spec("sklearn") is None:
        raise UsageError("fit needs scikit-learn: pip install 'prefixcache[fit]' (or pip install scikit-learn)")
    return questions


def labelled(q: Question, spec: TaskSpec, items: Sequence[Item], states: dict[str, np.ndarray], logprobs: np.ndarray,
             decisions: Sequence[Any], scored: Optional[np.ndarray] = None) -> Labelled:
    """One question's labelled data from the items, their views, log-probs and prompt decisions
    (None where the item's options were not scored: `scored` marks those that were)."""
    binary, k = q.kind.judged_each, len(q.options)
    prompt = np.array([d.probs if d is not None else [np.nan] * k for d in decisions], dtype=float)
    if binary:
        gold = np.array([[o in gold_tags(item.record, q.gold_field, q.options, spec.gold_sep) for o in q.options]
                         for item in items], dtype=np.bool_)
        said = np.array([d.on if d is not None else [False] * k for d in decisions], dtype=bool)
    else:
        golds = [_option(q, spec, item) for item in items]
        gold = np.array([q.options.index(g) for g in golds], dtype=int)
        said = np.array([-1 if d is None or d.best is None else d.best for d in decisions], dtype=int)
    prompted = None if scored is None or scored.all() else np.asarray(scored, dtype=bool)
    fields = spec.item_fields()
    groups = np.array([text_digest(item.record, fields) for item in items])
    _say_conflicts(q, items, groups, gold)
    return Labelled(q.id, q.options, binary, states, logprobs, gold, prompt, said, None if binary else q.threshold,
                    prompted, groups if len(set(groups)) < len(groups) else None,
                    notes=tuple(near_copies(items, groups, states)), ids=tuple(id_text(i.id) for i in items),
                    texts=tuple(" ".join(field_text(item.record.get(f)) for f in fields) for item in items),
                    picked=_picked(items))


NEAR = 0.9  # centred cosine of two items' final states from which they are near-copies (measured: one mark
# changed 0.91-0.98; paraphrases of one intent at most 0.87; other tickets at most 0.66)
NEAR_MAX = 4096  # items compared pairwise at most (the first ones)


def _picked(items: Sequence[Item]) -> np.ndarray | None:
    """[N] bool: the rows `suggest` picked (their `picked_by` says so and is not "random"); rows
    without it are taken as drawn at random. None when none was picked."""
    picked = np.array([str(i.record.get(PICKED_BY) or RANDOM).strip().lower() != RANDOM for i in items], dtype=bool)
    return picked if picked.any() else None


def near_copies(items: Sequence[Item], groups: np.ndarray, states: dict[str, np.ndarray]) -> list[str]:
    """A note naming pairs of labelled items of other texts that the model reads alike (their
    final states, centred, at cosine NEAR or more): near-copies, each perhaps judged by a head
    fitted on its twin, so the held-out figures may flatter the head."""
    view = states.get("state")
    if view is None or len(items) < 3:
        return []
    x = view[:NEAR_MAX, 0, :].astype(np.float64)
    x -= x.mean(axis=0)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x /= np.where(norms > 0, norms, 1)
    near = np.argwhere(np.triu(x @ x.T >= NEAR, k=1))
    pairs = [(i, j) for i, j in near if groups[i] != groups[j]]
    if not pairs:
        return []
    shown = ", ".join(f"{items[i].id!r} and {items[j].id!r}" for i, j in pairs[:3])
    return [f"{len(pairs)} pair{'s' if len(pairs) != 1 else ''} of labelled items of other texts the model reads "
            f"alike (near-copies: {shown}{' ...' if len(pairs) > 3 else ''}): a fold may hold one and its twin, "
            f"so the held-out figures may flatter the head"]


def _say_conflicts(q: Question, items: Sequence[Item], groups: np.ndarray, gold: np.ndarray) -> None:
    """Warn of one text labelled under two ids with different gold (one of them is likely wrong;
    both are kept, in one fold), naming the first few."""
    first: dict[str, int] = {}
    clashes = []
    for i, group in enumerate(groups):
        j = first.setdefault(group, i)
        if j != i and not np.array_equal(gold[i], gold[j]):
            clashes.append((j, i))
    if not clashes:
        return

    def answer(i: int) -> str:
        return "+".join(o for o, on in zip(q.options, gold[i]) if on) if gold.ndim == 2 else q.options[gold[i]]
    shown = "; ".join(f"{items[j].id!r} says {answer(j)!r}, {items[i].id!r} {answer(i)!r}" for j, i in clashes[:3])
    more = f" and {len(clashes) - 3} more" if len(clashes) > 3 else ""
    log.warning("question %r: %d labelled item%s the text of an earlier one with other gold (%s%s): both are kept "
                "(in one fold), but one of each pair is likely mislabelled", q.id, len(clashes),
                " has" if len(clashes) == 1 else "s have", shown, more)


def _option(q: Question, spec: TaskSpec, item: Item) -> str:
    """The item's gold option for a question (the spec's check of the item has passed)."""
    if spec.questions:
        option = pack_kind(q).option_of(q, item.record[q.gold_field])
        if option is None:
            raise ValueError(f"item {item.id!r}: its gold for {q.id!r} is not one of the answers")
        return option
    return gold_value(item.record, q.gold_field)


def _write(result: FitResult, readouts: list, fingerprint: dict[str, str]) -> None:
    """The head file, then the fitted spec that names it, then the figures."""
    options, plan = result.options, result.plan
    fitted = {"items": len(plan.items), "folds": options.folds, "engine": {"name": result.engine, "precision": result.precision},
              "questions": {j.qid: {"verdict": j.verdict, "C": j.choice.C, "features": j.choice.features}
                            for j in result.judged},
              "labelled": labelled_keys(plan.spec, plan.items)}
    safefile.replace(options.head_path, head_bytes(readouts, fingerprint, LAYER, fitted), "the head file")
    keys: dict[str, Any] = {**relocated(plan.spec_file.data, options.run.spec, options.output),
                            **model_key(options.run.model), "head": options.head_path.name}
    if result.engine != default_backend().name and plan.spec.backend != result.engine:
        keys["backend"] = result.engine  # the head read its states: it runs where they were read
    tags = next((j for j in result.judged if j.thresholds), None)
    if tags is not None and tags.thresholds is not None and not plan.spec.questions:
        keys["threshold"] = dict(zip(plan.spec.label_names, tags.thresholds))
    keys.update(cut_keys(plan, result.judged))
    write_tuned(options.output, plan.spec_file, keys, header(result), by="fit")
    result.written = [options.output, options.head_path, options.figures_path]
    safefile.replace(options.figures_path, json.dumps(result.to_json(), indent=2, ensure_ascii=False) + "\n",
                     "the figures")


def model_key(model: Optional[str]) -> dict[str, str]:
    """The fitted spec's `model` where fit was given one (-m): the head read that model's states,
    so the spec names it (a local file or folder by its absolute path)."""
    if not model:
        return {}
    local = Path(model).expanduser()
    return {"model": str(local.resolve()) if local.exists() else model}


def labelled_keys(spec: TaskSpec, items: Sequence[Item]) -> dict[str, list[str]]:
    """What the head was fitted on, as `suggest` leaves it out and the next fit compares with it:
    the items' ids and the digests of their template fields' text."""
    fields = spec.item_fields()
    return {"ids": [id_text(i.id) for i in items], "texts": [text_digest(i.record, fields) for i in items]}


def header(result: FitResult) -> str:
    """The fitted spec's first comment lines: what decides, and on what evidence."""
    folds = result.judged[0].folds if result.judged else result.options.folds
    lines = [f"prefixcache fit: a head fitted on {len(result.plan.items)} labelled items decides "
             f"({folds}-fold cross-validation, held out)"]
    for j in result.judged:
        lines.append(f"{j.qid}: accuracy {_interval(j.head['accuracy'])} with the head, "
                     f"{_interval(j.prompt['accuracy'])} with the prompt alone")
    return "\n".join(lines)


def _interval(figure: Any) -> str:
    """A held-out figure with its interval, as the header says it."""
    return f"{figure.value:.3f} [{figure.low:.3f}, {figure.high:.3f}]" if isinstance(figure, Figure) else "-"
