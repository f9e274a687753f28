"""`prefixcache suggest SPEC POOL -n 50 -o to_label.csv`: the unlabelled items worth labelling next.

Every check that needs no model comes first (the spec and its head, the pool, the labelled items
to leave out, the file to write). Then the pool goes through the model once in `run`'s batches:
with a head of the state alone (or none), each item's tokens only, as a head-only run reads them;
with a head that also reads the options' scores, every option is scored as `run` does. The head's
margins and the states choose the items (labelled/picking.py); the file holds each one's id, its
template fields and, in the gold column `fit` reads, the head's guess for the person to correct
(empty without a head), its probability and the margin.

An item already labelled is never suggested: by id, and by what its template fields say (a copy
of a text under another id). Labelled are the items the spec's head was fitted on (the head file
lists them), those of the files given with `--labelled`, and pool items whose gold is filled in.

Two draws read no model: `--random`, a uniform sample of the pool (the rows `fit` estimates on),
and `--audit OUTPUT`, a uniform sample of the items a run's records (OUTPUT, the run of the pool)
answered, for `run --min-answered-accuracy` to bound the answered items' accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..data.items import Item, item_sha, read_items, text_digest
from ..data.output import check_distinct, fingerprint_path, read_fingerprint, read_records
from ..data.records import id_text, record_id, repeated
from ..errors import InputError, OutputError, UsageError
from ..run.options import RunOptions
from ..run.plan import check_reads_states, load_options_spec, spec_identity
from ..run.review import gold_column, write_review
from ..scoring.prepare import Batching
from ..task.specfile import read_spec_file
from ..task.spec import TaskSpec, is_missing
from ..run.labelled import labelled_items
from ..task.tuned import check_tuned_output

Step = Callable[[str, int, int], None]


@dataclass(frozen=True)
class SuggestOptions:
    """`run` carries the spec (fitted or not), the pool (`items`), the model and batches."""

    run: RunOptions
    output: Path
    n: int = 50
    seed: int = 0
    labelled: tuple[str, ...] = ()  # files of labelled items, never suggested
    overwrite: bool = False
    random: bool = False  # a uniform sample of the pool (no model): rows `fit` estimates on
    audit: Optional[str] = None  # a run's output of the pool: a uniform sample of the items it answered


@dataclass(frozen=True)
class Known:
    """What is labelled already: ids (as text) and digests of the template fields' text."""

    ids: frozenset[str]
    texts: frozenset[str]

    def has(self, item: Item, fields: Sequence[str]) -> bool:
        return id_text(item.id) in self.ids or text_digest(item.record, fields) in self.texts


@dataclass(frozen=True)
class SuggestPlan:
    spec: TaskSpec
    pool: list[Item]  # the unlabelled items, in file order
    left_out: int  # pool items labelled already (by id, text or a filled gold)
    copies: int = 0  # pool items whose text an earlier one has (each text is offered once)
    unanswered: int = 0  # --audit: pool items the run abstained on, failed on or has no record of


def without_gold(spec: TaskSpec) -> TaskSpec:
    """The spec the pool is read with: no gold field asked of its items."""
    return replace(spec, gold=None, questions=tuple(replace(q, gold=None) for q in spec.questions))


@dataclass
class SuggestResult:
    plan: SuggestPlan
    picked: list[dict[str, Any]]  # the rows written
    skipped: int  # pool items that could not be scored (too long for the model)
    ms_per_item: float
    pool_margin: Optional[float] = None  # the pool's median margin (None without a head)
    written: list[Path] = field(default_factory=list)
    drawn: str = ""  # a uniform sample, no model read: RANDOM (--random) or AUDIT (--audit)

    @property
    def audited(self) -> bool:
        """Drawn from the items a run answered (`--audit`)."""
        return self.drawn == AUDIT


def plan_suggest(options: SuggestOptions) -> SuggestPlan:
    """Every check that needs no model: the spec (and its head's file), the pool, the labelled files."""
    o = options.run
    if options.n < 1:
        raise UsageError("-n must be 1 or more")
    if options.random and options.audit is not None:
        raise UsageError("--random draws from the whole pool and --audit from the items a run answered: give one")
    spec = load_options_spec(o, read_spec_file(o.spec))
    if spec.choices:
        raise UsageError(f"{o.spec}: suggest picks items for a head of one set of answers; with 'choices' each item "
                         f"has its own options")
    check_tuned_output(options.output, o.spec, options.overwrite)
    if not (options.random or options.audit is not None):  # a sample drawn without the model reads no state
        check_reads_states(spec, o, "suggest")
    check_distinct({"-o": options.output}, {"POOL": o.items, "the spec": o.spec,
                                            "the spec's head": spec.head.path if spec.head is not None else None,
                                            "--audit": options.audit,
                                            **{f"--labelled {p}": p for p in options.labelled}})
    pool = labelled_items(o.items, o, [without_gold(spec)], "suggest reads its pool from a file")
    known = known_items(spec, options.labelled, o)
    fields = spec.item_fields()
    unlabelled = [item for item in pool if not known.has(item, fields) and not has_gold(spec, item)]
    if not pool:
        raise UsageError(f"{o.items}: the pool holds no items: nothing to suggest")
    if not unlabelled:
        raise UsageError(f"{o.items}: every item of the pool is labelled already (by id, text or a gold value): "
                         f"nothing to suggest")
    fresh = distinct(unlabelled, fields)
    if options.audit is not None:
        check_audited_run(options.audit, spec, o)
    audited = answered_items(options.audit, fresh, spec) if options.audit is not None else fresh
    return SuggestPlan(spec, audited, len(pool) - len(unlabelled), len(unlabelled) - len(fresh),
                       len(fresh) - len(audited))


def answered_items(output: str, items: Sequence[Item], spec: TaskSpec) -> list[Item]:
    """`--audit`: the items a run's records answered (a label, not an abstention or an error), in
    pool order. Refused where the records do not say it: a spec of tags or questions, a record
    scored from other fields than the pool's item (the pool is not the input of that run), or no
    item answered."""
    if spec.multi_label or spec.questions:
        raise UsageError(f"--audit draws the items a head of one set of labels answered; "
                         f"{'tags' if spec.multi_label else 'questions'} have no answered items to audit")
    written = read_records(output).records
    twice = repeated(written)
    if twice is not None:
        raise InputError(f"{output}: holds two records for item {twice.get('id')!r}: it was changed after the run wrote "
                         f"it, and its answers are not that run's; audit an output as the run wrote it")
    records = {record_id(r): r for r in written}
    answered = []
    for item in items:
        record = records.get(id_text(item.id))
        if record is None or "error" in record or record.get("label") is None:
            continue
        why = _not_decided(record, spec)
        if why:
            raise InputError(f"{output}: the record of item {item.id!r} {why}: it was changed after the run wrote it, "
                             f"and an audit of its answers would bound other answers than the run's")
        if record.get("item_sha") not in (None, item_sha(item.record)):
            raise InputError(f"{output}: item {item.id!r} was scored from other fields than the pool's: --audit draws "
                             f"from the items of the run that wrote {output}; give that run's input as POOL")
        answered.append(item)
    if not answered:
        raise UsageError(f"{output}: no item of the pool was answered there (abstained, failed or not run): "
                         f"nothing to audit")
    return answered


def check_audited_run(output: str, spec: TaskSpec, options: RunOptions) -> None:
    """`--audit`: OUTPUT was written by a run of this spec (the same file, model and head), as
    its fingerprint says; an audit of another spec's answers bounds nothing this spec answers."""
    try:
        written = read_fingerprint(output)
    except OutputError:
        raise InputError(f"{output}: {fingerprint_path(output).name}, the fingerprint of the run that wrote it, is "
                         f"missing or unreadable: an audit needs to know which spec, model and head answered") from None
    ours = spec_identity(spec, options.spec)
    names = {"spec": f"spec than {options.spec}", "model": "model", "head": "head"}
    for part in names:
        if written.get(part) != ours.get(part):
            raise InputError(f"{output}: was written by a run of another {names[part]} (its fingerprint says so): "
                             f"--audit bounds the answers of this spec's run; give the output of `prefixcache run "
                             f"{options.spec}` on the pool")


def _not_decided(record: Any, spec: TaskSpec) -> str:
    """Why an answered record's label is not what its probabilities decide under the spec (its
    most probable label, at or above the spec's threshold); "" when it is."""
    probs = record.get("probs")
    if not isinstance(probs, dict) or record["label"] not in probs:
        return "has a label but not its probability"
    try:
        top, mine = max(float(p) for p in probs.values()), float(probs[record["label"]])
    except (TypeError, ValueError):
        return "holds probabilities that are not numbers"
    if mine < top - 1e-6:
        return f"answers {record['label']!r}, not its most probable label"
    if spec.threshold is not None and mine < spec.threshold - 1e-6:
        return f"answers {record['label']!r} at {mine:.3f}, below the spec's threshold of {spec.threshold:g} (an abstention)"
    return ""


def distinct(items: Sequence[Item], fields: Sequence[str]) -> list[Item]:
    """The items, each text once (its first id): labelling a copy of a text teaches nothing new
    (case and runs of whitespace aside, as `text_digest` compares)."""
    seen: set[str] = set()
    out = []
    for item in items:
        digest = text_digest(item.record, fields)
        if digest not in seen:
            seen.add(digest)
            out.append(item)
    return out


def known_items(spec: TaskSpec, files: Sequence[str], o: RunOptions) -> Known:
    """The items the spec's head was fitted on, and those of `files` (any fields: ids and texts)."""
    fitted = spec.head.fitted.get("labelled", {}) if spec.head is not None else {}
    ids, texts = set(fitted.get("ids", ())), set(fitted.get("texts", ()))
    fields = spec.item_fields()
    for path in files:
        for item in read_items(path, None, spec.id_field, o.delimiter, o.encoding):
            ids.add(id_text(item.id))
            if all(f in item.record for f in fields):
                texts.add(text_digest(item.record, fields))
    return Known(frozenset(ids), frozenset(texts))


def has_gold(spec: TaskSpec, item: Item) -> bool:
    """Whether the item carries a gold value the spec's fit would read (labelled in the pool)."""
    golds = [q.gold for q in spec.questions if q.gold] if spec.questions else [spec.gold] if spec.gold else []
    return any(g in item.record and not is_missing(item.record[g]) and str(item.record[g]).strip() for g in golds)


def suggest(options: SuggestOptions, step: Step = lambda what, done, total: None,
            plan: Optional[SuggestPlan] = None) -> SuggestResult:
    """Read the pool's states (and the head's answers), pick, write the file."""
    from .passes import fit_scorer, read_pool  # torch: once the checks have passed
    from .picking import pick

    plan = plan or plan_suggest(options)
    if options.random or options.audit is not None:
        return _drawn(options, plan)
    o = options.run
    scorer = fit_scorer(without_gold(plan.spec), o.scoring())
    read = read_pool(scorer, plan.pool, Batching(o.batch_size, o.batch_tokens, on_error="skip"), step)
    margins = np.array(read.margins) if plan.spec.head is not None else None
    step("picking", 0, 0)
    picked = pick(read.vectors, margins, options.n, options.seed)
    rows = [row(plan.spec, read.items[i], read.answers[i], None if margins is None else margins[i]) for i in picked]
    for r in rows:
        r[PICKED_BY] = "least sure" if margins is not None else "spread"
    write_review(options.output, rows, "the suggested items")
    return SuggestResult(plan, rows, read.skipped, read.ms_per_item,
                         None if margins is None else float(np.median(margins)), [options.output])


PICKED_BY = "picked_by"  # how a suggested row was chosen: "random" rows are those `fit` estimates on
RANDOM = "random"
AUDIT = "audit"  # drawn at random from the answered items only: not the pool's mix, so fit does not estimate on it


def _drawn(options: SuggestOptions, plan: SuggestPlan) -> SuggestResult:
    """`--random` or `--audit`: a uniform sample of the plan's items (seeded), read by no model,
    its gold columns empty (no guess to anchor the person labelling)."""
    rng = np.random.default_rng(options.seed)
    chosen = sorted(rng.choice(len(plan.pool), size=min(options.n, len(plan.pool)), replace=False))
    how = RANDOM if options.audit is None else AUDIT
    rows = [{**row(plan.spec, plan.pool[i], None, None), PICKED_BY: how} for i in chosen]
    write_review(options.output, rows, "the suggested items")
    return SuggestResult(plan, rows, 0, 0.0, None, [options.output], drawn=how)


def row(spec: TaskSpec, item: Item, guesses: Optional[dict[str, tuple[str, float]]], margin: Optional[float]
        ) -> dict[str, Any]:
    """One suggested item: id, template fields, per question the head reads its guess in the gold
    column (to correct) and its probability, and the margin; without a head, empty gold columns."""
    out: dict[str, Any] = {"id": item.id}
    out.update({f: item.record.get(f) for f in spec.item_fields()})
    if guesses is None:
        for qid in [q.id for q in spec.questions] or [""]:
            out[gold_column(spec, qid)] = ""
        return out
    for qid, (guess, prob) in guesses.items():
        out[gold_column(spec, qid)] = guess
        out[f"{qid}_prob" if qid else "prob"] = round(prob, 6)
    out["margin"] = round(float(margin), 6) if margin is not None else ""
    return out
