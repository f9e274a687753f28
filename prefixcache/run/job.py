"""One run of `prefixcache run`, end to end: a `Job` takes `RunOptions` and gives a `RunResult`.

The phases are the Job's methods, in order: `plan` (everything that needs no model, `plan.py`),
`start` (how the output is begun or continued), `load` (the tokenizer, label lint, the model and
its prefilled prefix), `bounds` (this shard's items), `write` (the record stream into the output),
`join` (the parts of a multi-process launch) and `report` (evaluation files). It never prints:
progress and stop requests go through the callables it is given, log lines through `logging`, and
every failure is a typed error.

Example:
    result = Job(RunOptions(Path("spec.yaml"), "items.jsonl", output="out.jsonl")).run()
    result.stats.items, result.evaluation, result.exit_code
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from ..data.items import Item, ItemsDigest
from ..data.lock import output_lock
from ..data.output import read_fingerprint, read_records, write_fingerprint
from ..data.resume import (EXACT_BOUND, Start, checked_stream, continue_output, in_input_order, remove_orphans,
                           start_output)
from ..data.records import Record, id_text, ids_digest, is_error, item_sha
from ..errors import EXIT_GATE, EXIT_ITEM, EXIT_OK, InputError, Interrupted
from ..reports.evaluation import AnyEvaluation, Gates, add_record, evaluation_for, write_reports
from ..scoring.prepare import Task, spec_model
from ..task.familiar import beyond
from ..task.kind import COLLAPSE_MIN_ITEMS, COLLAPSE_SHARE
from ..task.lint import lint_labels, lint_layout
from ..task.questions import answer_word
from ..task.spec import LETTERS
from .options import RunOptions, command_line
from .pipeline import RunStats, classify
from .plan import Plan, make_plan, refusal_words
from .review import review_rows, write_review
from .shards import merge_launched, shard_range

if TYPE_CHECKING:  # the scorer brings torch: imported once a model is needed (load_scorer)
    from ..scoring.scorer import ItemScorer, Rescoring

log = logging.getLogger("prefixcache")


@dataclass(frozen=True)
class Event:
    """What a job reports as it goes. phase: "checked" (spec, input and output are valid; no
    model loaded yet), "loading" (`detail`: "tokenizer", or "model": loading it and its prefilled
    prefix), "scoring" (records are about to stream; `detail` says with what), "batch" (a batch
    was written)."""

    phase: str
    written: int = 0  # records written by this run so far
    total: Optional[int] = None  # records this run will write (None when reading stdin)
    rate: float = 0.0  # items per second of scoring
    detail: str = ""
    updating: bool = False  # --update: `total` items are checked, only new and changed ones scored
    already: int = 0  # records an earlier run wrote (a resume): the bar counts them done


Progress = Callable[[Event], None]
Stop = Callable[[], Optional[int]]  # the signal number that asks the run to stop, or None


@dataclass
class RunResult:
    """What a run did. `exit_code`: 0, EXIT_GATE when a gate was missed (`gate_failures`), or
    EXIT_ITEM when the output holds error records (written by this run or kept from an earlier one)."""

    output: Optional[str]
    stats: RunStats = field(default_factory=RunStats)
    resumed: int = 0  # records an earlier run had written
    first_record: Optional[float] = None  # seconds from the start to the first record written
    load_seconds: float = 0.0  # tokenizer and model
    prefill_ms: float = 0.0  # prefilling the prefix, or loading it from the store
    prefix_source: str = ""  # "computed" or "loaded"
    prefix_tokens: int = 0
    device: str = ""
    dtype: str = ""
    model: str = ""  # the model used, as given
    rescored: Optional[Rescoring] = None  # --exact: what was scored again in float32
    shard: Optional[tuple[int, int]] = None  # (k, n), 0-based k
    kept: int = 0  # --update: records kept from the output for items that did not change
    dropped: int = 0  # --update: records of items no longer in the input
    nothing_to_do: bool = False  # the output already held every item
    carried_errors: int = 0  # error records an earlier run wrote that the output still holds
    labels: Counter = field(default_factory=Counter)  # predictions written by this run, by label
    merged: Optional[int] = None  # records joined from the processes of a launch (its rank 0)
    processes: int = 1
    evaluation: Optional[AnyEvaluation] = None
    gates: Gates = Gates()
    reviewed: Optional[int] = None  # --review: abstained items written for a person to label

    @property
    def gate_failures(self) -> list[str]:
        return self.evaluation.gate_failures(self.gates) if self.evaluation else []

    @property
    def gate_failed(self) -> bool:
        return bool(self.gate_failures)

    @property
    def exit_code(self) -> int:
        return EXIT_GATE if self.gate_failed else EXIT_ITEM if self.stats.errors or self.carried_errors else EXIT_OK


def output_start(plan: Plan, fingerprint: dict) -> Start:
    """How the plan's output starts (fresh, resumed, grown, updated), refused (OutputError) where
    it cannot be continued with this fingerprint; its records checked to be the input's first
    items in order. Nothing is written: the run and its dry run ask the same."""
    options = plan.options
    begun = start_output(plan.output.path, fingerprint, options.resume, options.update, options.items,
                         refusal_words, plan.output.fmt)
    if begun.appends and not plan.stream and not plan.part and begun.records:  # a shard's start is its own
        begun = in_input_order(plan.output.file, begun, islice(plan.read_input(), len(begun.records)),
                               options.items, options.update)
    if options.update and begun.appends and any(map(is_error, begun.records.values())):
        begun = Start("update", begun.records)  # an update tries the items that could not be scored again
    return begun


def run_job(options: RunOptions, progress: Optional[Progress] = None, stop: Optional[Stop] = None) -> RunResult:
    """`Job(options, progress, stop).run()`."""
    return Job(options, progress, stop).run()


class Job:
    """One run from plan to result. The attributes are what the phases settle, in order: `plan`,
    `fingerprint`, `begun` (how the output starts), `task`, `scorer`, `first`/`last` (the items
    this process scores), `result`."""

    def __init__(self, options: RunOptions, progress: Optional[Progress] = None, stop: Optional[Stop] = None):
        self.options = options  # the plan holds this same object
        self.progress: Progress = progress or (lambda event: None)
        self.stop: Stop = stop or (lambda: None)
        self.started = time.perf_counter()
        self.plan: Plan
        self.fingerprint: dict = {}
        self.begun: Start
        self.task: Task
        self.scorer: ItemScorer
        self.first: int = 0
        self.last: int | None = None
        self.written: Counter = Counter()  # every record this run writes, by label (kept ones too)
        self.tag_shapes: Counter = Counter()  # multi-label: records with no tag, every tag or some
        self.novel: Counter = Counter()  # records whose novelty was measured ("read"), and beyond 1 ("outside")
        self.reading: Optional[ItemsDigest] = None  # the items this run read, to compare with the plan's

    def run(self) -> RunResult:
        self.plan = make_plan(self.options)
        with output_lock(self.plan.output.path):  # one writer per output: an overlapping run is refused
            if self.plan.output.is_file:
                remove_orphans(self.plan.output.file)  # what a killed writer left (an update's aside)
            return self._run()

    def _run(self) -> RunResult:
        self.progress(Event("checked", total=self.plan.total))
        self.fingerprint = self.plan.fingerprint()
        if not self.plan.part:  # a shard's items are known once batches can be formed: after the model loads
            self.begun = self.start()
            if self.complete():
                return self.nothing_to_do()
        self.load()
        self.bounds()
        if self.plan.part:
            self.begun = self.start()
        self.result = self.new_result()
        self.write()
        self.check_read_all()
        self.review()
        self.result.rescored = self.scorer.rescoring()
        self.warn_if_collapsed()
        self.say_unfamiliar()
        if self.plan.launched:
            self.join()
        self.report()
        return self.result

    # -- the output -------------------------------------------------------------------------
    def start(self) -> Start:
        """How the output starts (see `output_start`)."""
        return output_start(self.plan, self.fingerprint)

    def complete(self) -> bool:
        """A resumed output that already holds a record for every item of the same input."""
        return self.begun.mode == "resume" and self.plan.total is not None and len(self.begun.records) >= self.plan.total

    def nothing_to_do(self) -> RunResult:
        continue_output(self.plan.output.file, self.fingerprint, self.plan.output.fmt)  # a damaged last line goes
        self.result = RunResult(self.plan.output.path, resumed=len(self.begun.records), nothing_to_do=True,
                                carried_errors=sum(map(is_error, self.begun.records.values())),
                                evaluation=evaluation_for(self.plan.spec, self.begun.records.values()),
                                gates=self.plan.gates)
        self.review()
        self.report()
        return self.result

    def review(self) -> None:
        """--review: the abstained items of the complete output, joined with the input, written whole."""
        path = self.options.review
        if path is None:
            return
        records = {id_text(r["id"]): r for r in read_records(self.plan.output.file).records}
        rows = review_rows(self.plan.spec, islice(self.plan.read_input(), self.first, self.last), records)
        write_review(path, rows)
        self.result.reviewed = len(rows)
        log.info("review: %d abstained item%s to label in %s", len(rows), "" if len(rows) == 1 else "s", path)

    # -- the model --------------------------------------------------------------------------
    def load(self) -> None:
        """The tokenizer (and label lint), then the model and its prefilled prefix."""
        self.progress(Event("loading", detail="tokenizer"))
        self.task = Task.from_spec(self.plan.spec, self.options.cache_dir)
        for warning in [*lint_layout(self.task.builder), *(lint_labels(self.task.builder) if self.plan.spec.labels else ())]:
            log.warning("%s", warning)
        self.progress(Event("loading", detail="model"))
        self.scorer = load_scorer(self.task, self.plan)
        self._carry_bound()

    def _carry_bound(self) -> None:
        """--exact continuing an output: re-score close calls by the bound the output's earlier
        run had reached (kept in its fingerprint), not one measured anew, so the records are those
        of an uninterrupted run."""
        if not self.plan.says_precision or not self.begun.appends:
            return
        bound = read_fingerprint(self.plan.output.file).get(EXACT_BOUND)
        if isinstance(bound, (int, float)) and bound > 0 and self.scorer.carry_bound(float(bound)):
            self.fingerprint[EXACT_BOUND] = float(bound)

    def _keep_bound(self) -> None:
        """--exact: the re-scoring bound as it stands, in the output's fingerprint (see _carry_bound)."""
        bound = self.scorer.exact_bound()
        if bound is not None and bound != self.fingerprint.get(EXACT_BOUND) and self.begun.mode != "update" \
                and self.plan.output.is_file:
            self.fingerprint[EXACT_BOUND] = bound
            write_fingerprint(self.plan.output.file, self.fingerprint)

    def bounds(self) -> None:
        """The items this process scores: all (up to --limit), or its shard's whole batches, so
        every shard forms the batches one process would. A shard's fingerprint names them."""
        plan = self.plan
        if not plan.part:
            self.first, self.last = 0, plan.total if plan.total is not None else self.options.limit
            return
        total = plan.total
        assert total is not None  # a shard's plan counts the input
        starts = self.task.batch_starts(islice(plan.read_input(), total), plan.batching, self.scorer.context) + [total]
        first, last = shard_range(len(starts) - 1, *plan.part)
        self.first, self.last = starts[first], starts[last]
        ids = (id_text(item.id) for item in islice(plan.read_input(), self.first, self.last))
        self.fingerprint.update(shard=f"{plan.part[0] + 1}/{plan.part[1]}", items=self.last - self.first,
                                ids=ids_digest(ids), of=plan.total)

    def new_result(self) -> RunResult:
        scorer, updating = self.scorer, self.begun.mode == "update"
        return RunResult(
            output=self.plan.output.path, resumed=0 if updating else len(self.begun.records),
            carried_errors=sum(map(is_error, self.begun.done.values())),
            load_seconds=self.task.load_seconds + scorer.load_seconds, prefill_ms=scorer.prefix.prefill_ms,
            prefix_source=scorer.prefix_source, prefix_tokens=len(scorer.prefix.ids), device=scorer.device,
            dtype=scorer.dtype, shard=self.plan.part, model=self.task.source.ref, gates=self.plan.gates,
            evaluation=evaluation_for(self.plan.spec, () if updating else self.begun.records.values()),
        )

    # -- the records ------------------------------------------------------------------------
    def write(self) -> None:
        """Score the items and write their records (see `OutputFile.writing`)."""
        result = self.result
        try:
            with self.plan.output.writing(self.begun, self.fingerprint) as writer:
                for record in self.records():
                    writer.write(record)
                    labels = _labels_of(record)
                    self.written.update(labels)
                    if "labels" in record:
                        self.tag_shapes[_tag_shape(record, len(self.plan.spec.labels))] += 1
                    if "novelty" in record:
                        self.novel.update(read=1, outside=int(beyond(record["novelty"])))
                    if record is not self.begun.records.get(id_text(record["id"])):  # scored by this run
                        result.labels.update(labels)
                    result.first_record = result.first_record or time.perf_counter() - self.started
                    if result.evaluation:
                        add_record(result.evaluation, record)
        except _Stopped:
            raise
        except InputError as exc:  # a bad line met while streaming: what was written before it stays
            written = self.result.stats.items
            if not self.plan.output.is_file or not written or self.begun.mode == "update":
                raise
            raise InputError(f"{exc}; the {written} records before it are kept in {self.options.output}: fix the "
                             f"input, then {self._go_on()}") from None
        except Interrupted as exc:  # a stop from outside the batch loop (a batch abandoned, a second Ctrl-C)
            if self.options.output in (None, "-"):
                raise
            raise Interrupted(exc.signum, f"{exc}; {self._go_on()}") from None

    def check_read_all(self) -> None:
        """The run read the items the check before it read: an input rewritten in place between
        the two, or while the run read it, must not end in exit 0 with a part of its records."""
        planned, read = self.plan.scanned, self.reading
        if planned is None or read is None:
            return
        name, kept = self.options.items, "the records written are kept"
        if read.count < planned.count:
            last = f" (the last was item {read.last!r})" if read.count else ""
            raise InputError(f"{name}: changed while it was read: the check before the run found {planned.count} "
                             f"items, the run read {read.count}{last}; {kept}: when the file is complete again, run "
                             f"the same command with --update to score the {planned.count - read.count} missing items "
                             f"and any that changed")
        if read.count != planned.count or read.hexdigest() != planned.hexdigest():
            raise InputError(f"{name}: changed while it was read: its items are not the ones the check before the "
                             f"run read; {kept}: run the same command with --update to score the changed items again")

    def records(self) -> Iterator[Record]:
        """The records to write, in input order: for a fresh or resumed output those not written
        yet; for an update, every item's (an unchanged item's kept record, a new or changed one's
        fresh record)."""
        done = self.begun.done
        left = None if self.last is None else max(self.last - self.first - len(done), 0)
        self.progress(Event("scoring", 0, left, detail=self._describe(done), updating=self.begun.mode == "update",
                            already=len(done)))
        items: Iterator[Item] = islice(self.plan.read_input(), self.first, self.last)
        if self.plan.scanned is not None and not self.plan.part:
            self.reading = ItemsDigest()
            items = self.reading.follow(items)
        if self.plan.stream:  # read once, never scanned: check it as it streams
            items = checked_stream(items, self.options.items, done)
        items = self._calibrated(items)
        if self.begun.mode != "update":
            yield from self._classify(items, done, left)
            return
        yield from self._updated(items, left)

    def _calibrated(self, items: Iterator[Item]) -> Iterator[Item]:
        """What the scorer measures on the input's first items before scoring any (--exact: its
        bound), so that every record follows from it whatever the batches, --limit or shard: read
        from the input afresh (a stream, read once, from `items`)."""
        wanted = self.scorer.calibration_items()
        if not wanted:
            return items
        if not self.plan.stream:
            self.scorer.calibrate(islice(self.plan.read_input(), wanted))
            return items
        head, rest = _peek(items, wanted)
        self.scorer.calibrate(head)
        return chain(head, rest)

    def _classify(self, items: Iterator[Item], done: Mapping[str, Any], left: Optional[int]) -> Iterator[Record]:
        stats = self.result.stats

        def after_batch(n: int) -> None:
            log.debug("batch: %d records, %d written, %.1f items/s", n, stats.items, stats.items_per_second)
            self._keep_bound()
            self.progress(Event("batch", stats.items, left, stats.items_per_second, already=len(done)))
            signum = self.stop()
            if signum:
                raise self._interrupted(signum)

        return classify(self.scorer, items, self.plan.batching, stats, done, after_batch, self.plan.keep)

    def _updated(self, items: Iterator[Item], left: Optional[int]) -> Iterator[Record]:
        """--update: unchanged items keep their records, the rest are scored (an item that could not
        be scored is tried again); all in input order."""
        order: deque = deque()  # per item in input order: its kept record, or None when it is scored
        old, gone = self.begun.records, set(self.begun.records)

        def changed() -> Iterator[Item]:
            for item in items:
                gone.discard(id_text(item.id))
                record = old.get(id_text(item.id))
                kept = record is not None and record.get("item_sha") == item_sha(item.record) and not is_error(record)
                order.append(record if kept else None)
                self.result.kept += kept
                if not kept:
                    yield item

        for record in self._classify(changed(), {}, left):
            while order[0] is not None:
                yield order.popleft()
            order.popleft()
            yield record
        yield from order
        self.result.dropped = len(gone)

    def _describe(self, done: Mapping[str, Any]) -> str:
        o, scorer = self.options, self.scorer
        return (f"spec {o.spec}, input {o.items}, output {self.plan.output.path or 'stdout'}, model "
                f"{self.task.source.ref}, {scorer.device} {scorer.dtype}, prefix {len(scorer.prefix.ids)} tokens "
                f"{scorer.prefix_source}{', ' + str(len(done)) + ' records already written' if done else ''}")

    def _go_on(self) -> str:
        """How to continue after a stop: the command that resumes (or, for an update, redoes) it."""
        if self.begun.mode == "update":
            return f"{self.options.output} is unchanged; update it with: {command_line(self.options)}"
        return f"resume with: {command_line(self.options)}"

    def _interrupted(self, signum: int) -> _Stopped:
        """A stop between batches, asked for by `stop`: what was written and how to go on."""
        name, output, written = signal.Signals(signum).name, self.options.output, self.result.stats.items
        if output in (None, "-"):
            return _Stopped(signum, f"interrupted by {name}: {written} records written")
        if self.begun.mode == "update":
            return _Stopped(signum, f"interrupted by {name}: {self._go_on()}")
        before = len(self.begun.done)
        held = f" ({before + written} in all)" if before else ""
        return _Stopped(signum, f"interrupted by {name}: {written} records written to {output} by this run{held}; "
                                f"{self._go_on()}")

    # -- after the records ------------------------------------------------------------------
    def warn_if_collapsed(self) -> None:
        """Predictions piled on one label usually mean a model biased toward it, not such data."""
        whole = self.written + Counter(x for r in self.begun.done.values() for x in _labels_of(r))  # the output
        counts = {k: n for k, n in whole.items() if not k.startswith("(")}
        total = sum(counts.values())
        spec = self.plan.spec
        if spec.multi_label:
            self._warn_if_tags_collapsed()
            return
        if spec.questions:
            self._warn_if_answers_collapsed(counts)
            return
        if spec.choices or len(spec.labels) < 2 or total < COLLAPSE_MIN_ITEMS:
            return
        label, n = max(counts.items(), key=lambda kv: kv[1])
        if n / total >= COLLAPSE_SHARE:
            log.warning("%.0f%% of the items (%d of %d) got the label %r: unless the data is that skewed, the model "
                        "favours it whatever the item; %s, and check on labelled items with --gold", 100 * n / total, n,
                        total, label, _remedy(bool(spec.content_free), "'calibrate: true' or 'normalize: pmi' in the spec"))

    def say_unfamiliar(self) -> None:
        """How many items lie beyond the rows the head was fitted on (about 1% of items like them
        do): many more mean inputs the head never learnt from, whose answers are guesses."""
        read, outside = self.novel["read"], self.novel["outside"]
        if not read:
            return
        share = outside / read
        line = (f"{outside} of {read} items ({100 * share:.1f}%) lie beyond 99% of the rows the head was fitted on "
                f"(novelty above 1 in their records)")
        if read >= COLLAPSE_MIN_ITEMS and share >= UNFAMILIAR_SHARE:
            log.warning("%s: they are unlike what it learnt from, and its answers to them are guesses; label some "
                        "(prefixcache suggest) and fit again", line)
        else:
            log.info("%s", line)

    def _warn_if_answers_collapsed(self, counts: dict[str, int]) -> None:
        """Typed questions: one answer for most items of a choice or yes/no question usually means a
        model biased toward it (a score question's levels may well pile up)."""
        for q in self.plan.spec.questions:
            if not q.kind.collapses:
                continue
            mine = {word: n for k, n in counts.items() if k.startswith(f"{q.id}=")
                    for word in [k[len(q.id) + 1:]] if not word.startswith("(")}
            total = sum(mine.values())
            if total < COLLAPSE_MIN_ITEMS:
                continue
            word, n = max(mine.items(), key=lambda kv: kv[1])
            if n / total >= COLLAPSE_SHARE:
                log.warning("%.0f%% of the items (%d of %d) got %r for question %r: unless the data is that skewed, "
                            "the model favours it whatever the item; %s, and check on labelled items with its 'gold'",
                            100 * n / total, n, total, word, q.id,
                            _remedy(bool(q.content_free), "'calibrate: true' on the question"))

    def _warn_if_tags_collapsed(self) -> None:
        """Multi-label: no tag, or every tag, on most items usually means thresholds that do not
        fit this model, not such data."""
        every = len(self.plan.spec.labels)
        shapes = Counter(self.tag_shapes)
        for r in self.begun.done.values():
            if not is_error(r):
                shapes[_tag_shape(r, every)] += 1
        total = sum(shapes.values())
        if total < COLLAPSE_MIN_ITEMS:
            return
        for shape, words in (("none", "no tag"), ("all", f"every tag (all {every})")):
            if shapes[shape] / total >= COLLAPSE_SHARE:
                fix = "lower" if shape == "none" else "raise"
                log.warning("%.0f%% of the items (%d of %d) got %s: unless the data is like that, the thresholds do "
                            "not fit this model; %s 'threshold' in the spec%s, and check on labelled items with --gold",
                            100 * shapes[shape] / total, shapes[shape], total, words, fix,
                            "" if self.plan.spec.content_free else " or try 'calibrate: true'")

    def join(self) -> None:
        """After every process of a launch wrote its part: rank 0 joins them into the output and
        evaluates the whole; the other ranks report nothing."""
        result, output, launched = self.result, self.options.output, self.plan.launched
        assert launched is not None and output is not None  # a launch writes parts of a file
        result.processes = launched.num_processes
        result.merged = merge_launched(launched, output)
        result.output = output
        if result.merged is None:
            result.evaluation = None
        elif result.evaluation is not None:
            result.evaluation = evaluation_for(self.plan.spec, read_records(output).records)

    def report(self) -> None:
        """The evaluation files asked for (--metrics, --summary-md, --junit)."""
        if self.result.evaluation:
            o = self.options
            model = self.result.model or spec_model(self.plan.spec).ref
            about = f"spec `{o.spec}` · model `{model}` · input `{o.items}` · output `{o.output or 'stdout'}`"
            write_reports(self.result.evaluation, o.metrics, o.summary_md, o.junit, self.result.gates,
                          self.result.stats.seconds, about)


class _Stopped(Interrupted):
    """A stop the job itself raised between batches: its message already says how to go on."""


def _tag_shape(record: Record, every: int) -> str:
    """A multi-label record's tags: "none", "all" of the `every` labels, or "some"."""
    n = len(record.get("labels") or ())
    return "none" if n == 0 else "all" if n == every else "some"


def _remedy(calibrated: bool, calibration: str) -> str:
    """What a collapse warning suggests: calibration, unless it is calibrated already."""
    if calibrated:
        return "it is calibrated already: try other examples or instructions, or another model (-m)"
    return f"try {calibration}"


def _labels_of(record: Record) -> list[str]:
    """What a record is counted as in the summary: its label; for multiple choice, the option's
    letter (the options differ per item); for multi-label, each label on, or "(none)"."""
    if is_error(record):
        return ["(error)"]
    if "answers" in record:  # typed questions: each answer in a word, under its question's id
        return [f"{qid}={answer_word(answer)}" for qid, answer in record["answers"].items()]
    if "labels" in record:
        return list(record["labels"]) or ["(none)"]
    if record["label"] is None:
        return ["(abstained)"]
    return [LETTERS[record["index"]] if record.get("index") is not None else str(record["label"])]


def load_scorer(task: Task, plan: Plan) -> ItemScorer:
    """The plan's scorer, built whole (scoring/build.py) on the plan's device and precision."""
    from ..scoring.build import build_scorer  # the torch side: imported once a model is needed

    return build_scorer(task, plan.options.scoring(device=plan.device, exact=plan.says_precision))


def _peek(items: Iterator[Item], count: int) -> tuple[list[Item], Iterator[Item]]:
    """The first `count` items and the rest; a bad line among them (a stream checked as it is read)
    is raised where it stands, after the items before it."""
    head: list[Item] = []
    try:
        for item in items:
            head.append(item)
            if len(head) >= count:
                break
    except InputError as exc:
        return head, _raising(exc)
    return head, items


def _raising(exc: InputError) -> Iterator[Item]:
    raise exc
    yield  # noqa: unreachable - a generator that raises when first read


UNFAMILIAR_SHARE = 0.1  # items beyond the fitted rows' 99% from which a run warns (about 1% is usual)
