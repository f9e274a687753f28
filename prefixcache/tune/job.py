"""One `prefixcache tune`, end to end: `tune(TuneOptions)` gives a `TuneResult`.

Every check that needs no model comes first (the spec and its gold field, the variants, both item
files against every variant, the tuned spec's path); then each variant scores the items once
(tune/passes.py), every configuration is judged on held-out items (tune/selection.py), and the
choice is written as a spec (tune/tuned.py). It never prints: progress goes through `step`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ..data.items import Item, item_sha
from ..data.output import check_distinct
from ..errors import InputError, SpecError, UsageError
from ..run.options import RunOptions
from ..run.plan import load_options_spec
from ..scoring.prepare import Batching
from ..task.spec import gold_value, TaskSpec
from ..task.specfile import read_spec_file, SpecFile
from .rules import Decided, Gold, Rule, rules_for, spec_rule
from ..reports.resampling import cv_splits
from .selection import Config, Goal, Search, Selection, measured, select
from ..task.tuned import check_tuned_output, relocated, write_tuned
from ..run.labelled import labelled_items
from .variants import Variant, variants

METRICS = ("auto", "accuracy", "macro-f1")
MIN_ITEMS = 10  # fewer labelled items cannot tell configurations apart


@dataclass(frozen=True)
class TuneOptions:
    """What a tune takes. `run` carries the spec, the labelled items and how they are read, --gold,
    the model's revision and cache, the device and the batches."""

    run: RunOptions
    test: Optional[str] = None  # held-out items: choose on the labelled ones, measure on these
    variants: Optional[Path] = None
    systems: tuple[str, ...] = ()
    examples: tuple[Path, ...] = ()
    models: tuple[str, ...] = ()
    metric: str = "auto"  # accuracy, or macro-f1; auto: macro-F1 for multi-label tasks, accuracy otherwise
    min_coverage: Optional[float] = None  # fit abstention thresholds answering at least this share
    folds: int = 5
    seed: int = 0
    output: Optional[Path] = None  # the tuned spec
    overwrite: bool = False


@dataclass
class TuneResult:
    """What a tune found. `scored[i]` is `variants[i]`'s pass; `written`: the tuned spec's path."""

    options: TuneOptions
    spec: TaskSpec
    variants: list[Variant]
    scored: list[Any]  # tune/passes.py `Scored`
    selection: Selection
    items: int
    test_items: Optional[int] = None
    written: Optional[Path] = None
    chosen_keys: dict[str, Any] = field(default_factory=dict)  # what the tuned spec sets

    @property
    def kind(self) -> str:
        return "multi-label" if self.spec.multi_label else "multiple choice" if self.spec.choices else "labels"

    @property
    def how(self) -> str:
        """How the held-out figures are measured, in words."""
        if self.test_items is not None:
            return f"chosen on {self.items} labelled items, measured on {self.test_items} test items ({self.options.test})"
        return f"{self.selection.splits}-fold cross-validation over {self.items} items"


Step = Callable[[str, int, int], None]


@dataclass(frozen=True)
class TunePlan:
    """What the checks before any model settle."""

    spec: TaskSpec
    spec_file: SpecFile  # read once: a spec from a pipe can be read only once
    variants: list[Variant]
    items: list[Item]
    test: list[Item]
    goal: Goal


def plan_tune(options: TuneOptions) -> TunePlan:
    """Every check that needs no model: a mistake costs a second, not a model load."""
    o = options.run
    if options.metric not in METRICS:
        raise UsageError(f"--metric must be one of {', '.join(METRICS)}, not {options.metric!r}")
    if options.folds < 2:
        raise UsageError("--folds must be 2 or more")
    spec_file = read_spec_file(o.spec)
    base = load_options_spec(o, spec_file)
    if base.questions:
        raise SpecError(f"{base.path}: tune chooses the prompt and decision rule of a task with labels, choices or "
                        f"tags; a spec of typed questions is evaluated with run --metrics (docs/questions.md)")
    if not base.gold:
        raise SpecError("tune compares decisions with gold values: name the field with --gold FIELD (or 'gold' in the spec)")
    metric = options.metric if options.metric != "auto" else "macro-f1" if base.multi_label else "accuracy"
    if metric == "macro-f1" and base.choices:
        raise UsageError("--metric macro-f1 needs labels; multiple-choice options differ per item: use accuracy")
    if options.min_coverage is not None and (base.multi_label or metric != "accuracy"):
        raise UsageError("--min-coverage fits abstention thresholds for the accuracy of a task that picks one label "
                         "(a multi-label task's thresholds are fitted anyway)")
    check_tuned_output(options.output, o.spec, options.overwrite)
    check_distinct({"-o": options.output}, {"LABELLED": o.items, "--test": options.test, "--variants": options.variants,
                                            **{f"--examples {p}": p for p in options.examples}})
    found = variants(spec_file, base, options.variants, options.systems, options.examples, options.models, o.gold_sep)
    specs = list({id(v.spec): v.spec for v in found}.values())
    items = labelled_items(o.items, o, specs)
    test = labelled_items(options.test, o, specs) if options.test else []
    if options.test is None and len(items) < max(MIN_ITEMS, 2 * options.folds):
        raise InputError(f"{o.items}: {len(items)} labelled items are too few to choose by {options.folds}-fold "
                         f"cross-validation; tune needs at least {max(MIN_ITEMS, 2 * options.folds)}")
    if options.test is not None and min(len(items), len(test)) < MIN_ITEMS:
        short = o.items if len(items) < MIN_ITEMS else options.test
        raise InputError(f"{short}: too few items to tune on or measure with; tune needs at least {MIN_ITEMS} in each")
    _held_out(o.items, options.test, items, test)
    if not base.multi_label:
        classes = {str(gold_value(item.record, base.gold)) for item in items}
        if len(classes) < 2:
            raise InputError(f"{o.items}: every labelled item has the gold {next(iter(classes))!r} ({base.gold}); "
                             f"with one class every rule scores the same: tune needs items of two classes or more")
    threshold = base.tag_thresholds if base.multi_label else base.threshold
    return TunePlan(base, spec_file, found, items, test, Goal(metric.replace("-", "_"), options.min_coverage, threshold))


def _held_out(labelled: str, test_path: Optional[str], items: list[Item], test: list[Item]) -> None:
    """`--test` items are held out: not the labelled file, and none of its items among them."""
    if test_path is None:
        return
    try:
        same = os.path.samefile(labelled, test_path)
    except OSError:
        same = False
    if same:
        raise UsageError(f"--test {test_path}: is LABELLED itself; its figures would not be held out: "
                         f"give a file of other items, or leave --test out to cross-validate")
    seen = {item_sha(item.record) for item in items}
    shared = [item for item in test if item_sha(item.record) in seen]
    if shared:
        raise InputError(f"--test {test_path}: {len(shared)} of its {len(test)} items are also in {labelled} (first: "
                         f"item {shared[0].id!r}); figures on them would not be held out: remove them from one file")


def tune(options: TuneOptions, step: Step = lambda what, done, total: None, plan: Optional[TunePlan] = None
         ) -> TuneResult:
    """Plan, score every variant, choose, and write the tuned spec when asked."""
    from .passes import score_variants  # torch: once the checks have passed

    plan = plan or plan_tune(options)
    o = options.run
    rules = rules_for(plan.spec)
    everything = plan.items + plan.test
    scored = score_variants(plan.variants, everything, rules, o.scoring(), Batching(o.batch_size, o.batch_tokens), step)
    step("choosing", 0, 0)
    selection = choose(plan, [s.decided for s in scored], options)
    result = TuneResult(options, plan.spec, plan.variants, scored, selection, len(plan.items),
                        len(plan.test) if options.test else None)
    result.chosen_keys = chosen_keys(result)
    if options.output is not None:
        keys = {**relocated(plan.spec_file.data, o.spec, options.output), **result.chosen_keys}
        write_tuned(options.output, plan.spec_file, keys, header(result))
        result.written = options.output
    return result


def configs_for(spec: TaskSpec, count: int, goal: Goal) -> tuple[list[Config], Config]:
    """Every configuration of `count` variants, and the spec as written (listed first)."""
    fitted = [False] + ([True] if spec.multi_label or goal.min_coverage is not None else [])
    default = Config(0, spec_rule(spec), False)
    configs = [default] + [Config(v, rule, fit) for v in range(count) for rule in rules_for(spec) for fit in fitted
                           if Config(v, rule, fit) != default]
    return configs, default


def choose(plan: TunePlan, decided: list[dict[Rule, Decided]], options: TuneOptions) -> Selection:
    """Judge every configuration on held-out items and choose (see tune/selection.py)."""
    gold = Gold.of(plan.spec, [item.record for item in plan.items + plan.test])
    table = {(v, rule): d for v, rules in enumerate(decided) for rule, d in rules.items()}
    configs, default = configs_for(plan.spec, len(decided), plan.goal)
    search = Search(table, gold, plan.goal, configs, default)
    labelled = np.arange(len(plan.items))
    if options.test:
        splits = [(labelled, np.arange(len(plan.items), len(plan.items) + len(plan.test)))]
    else:
        splits = cv_splits(gold.strata(), options.folds, options.seed)
    return select(search, splits, labelled, options.seed)


def chosen_keys(result: TuneResult) -> dict[str, Any]:
    """The spec keys the tuned spec sets: the pick's rule and threshold, and its variant's keys.
    With no winner, none: the tuned spec is the spec as written."""
    selection = result.selection
    if selection.verdict != "winner":
        return {}
    pick, spec = selection.pick, result.spec
    variant = result.variants[pick.config.variant]
    keys: dict[str, Any] = {k: v for k, v in variant.keys.items() if k != "model"}
    if "model" in variant.keys:
        keys["model"] = variant.spec.model
    keys["normalize"] = pick.config.rule.normalize
    if bool(spec.content_free) != pick.config.rule.calibrate:
        keys["calibrate"] = pick.config.rule.calibrate
    threshold = threshold_value(spec, pick.threshold)
    if threshold != threshold_value(spec, spec.tag_thresholds if spec.multi_label else spec.threshold):
        keys["threshold"] = threshold
    return keys


def threshold_value(spec: TaskSpec, threshold: Any) -> Any:
    """A threshold as a spec writes it: None, one number, or (multi-label, when they differ) a
    mapping of label to number."""
    if threshold is None or isinstance(threshold, (int, float)):
        return None if threshold is None else float(threshold)
    values = [float(t) for t in np.broadcast_to(np.asarray(threshold, dtype=float), (len(spec.labels),))]
    return values[0] if len(set(values)) == 1 else dict(zip(spec.label_names, values))


def header(result: TuneResult) -> str:
    """The tuned spec's first comment lines: what was chosen, and on what evidence."""
    s = result.selection
    figure = s.goal.figure.replace("_", " ").replace("macro f1", "macro-F1")
    chosen = describe(result, s.pick.config)
    tuned, default = measured(s.tuned[s.goal.figure]), measured(s.default.figures[s.goal.figure])
    if s.verdict != "winner":
        return (f"prefixcache tune kept this spec: no configuration beat it beyond noise ({result.how}; "
                f"{figure} {default.value:.3f} as written)")
    return (f"prefixcache tune chose: {chosen}\n"
            f"held-out {figure} {tuned.value:.3f} [{tuned.low:.3f}, {tuned.high:.3f}] against {default.value:.3f} "
            f"for the spec as written ({result.how})")


def describe(result: TuneResult, config: Config) -> str:
    """A configuration in words: its variant and rule."""
    variant = result.variants[config.variant].name
    return f"{config.rule.name}{', fitted threshold' if config.fitted else ''}, prompt: {variant}"
