"""One run of `prefixcache run`, end to end: `RunOptions` in, `RunResult` out.

The phases, in order: check everything that needs no model (options, spec, the whole input,
the output file); load the tokenizer and lint the labels; load the model and get the prefilled
prefix (prefix store); find this shard's items; start or resume the output (fingerprint); stream
the records; join the parts of a multi-process launch; evaluate against gold values and write the
report files. It never prints: progress and stop requests go through the callables it is given,
log lines through `logging`, and every failure is a typed error.

Example:
    result = run_job(RunOptions(Path("spec.yaml"), "items.jsonl", output="out.jsonl"))
    result.stats.items, result.evaluation, result.exit_code
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from .. import compat
from ..errors import EXIT_GATE, EXIT_ITEM, EXIT_OK, InputError, Interrupted, OutputError
from ..data.items import Item, is_stream
from ..task.lint import lint_labels
from ..model.load import pick_device
from ..reports.evaluation import Evaluation, Gates, add_record, evaluation_for, write_reports
from ..data.output import (
    Start,
    continue_output,
    default_mode,
    start_output,
    write_fingerprint,
)
from .plan import (
    Plan,
    RunOptions,
    batching_of,
    command_line,
    gates_of,
    make_plan,
    read_input,
    run_fingerprint,
)
from ..data.records import (
    Record,
    columns,
    id_text,
    ids_digest,
    is_error,
    item_sha,
    open_writer,
    read_records,
)
from .pipeline import RunStats, classify
from .shards import merge_launched, shard_range
from ..scoring.prepare import Task

log = logging.getLogger("prefixcache")


@dataclass(frozen=True)
class Event:
    """What `run_job` reports as it goes. phase: "checked" (spec, input and output are valid; no
    model loaded yet), "loading" (`detail`: "tokenizer", or "model": loading it and its prefilled
    prefix), "scoring" (records
    are about to stream; `detail` says with what), "batch" (a batch was written)."""

    phase: str
    written: int = 0  # records written by this run so far
    total: Optional[int] = None  # records this run will write (None when reading stdin)
    rate: float = 0.0  # items per second of scoring
    detail: str = ""


Progress = Callable[[Event], None]
Stop = Callable[[], Optional[int]]  # the signal number that asks the run to stop, or None


@dataclass
class RunResult:
    """What a run did. `exit_code`: 0, EXIT_GATE when a gate was missed (`gate_failures`), or
    EXIT_ITEM when items were written as error records."""

    output: Optional[str]
    stats: RunStats
    resumed: int  # records an earlier run had written
    first_record: Optional[float]  # seconds from the start to the first record written
    load_seconds: float  # tokenizer and model
    prefill_ms: float  # prefilling the prefix, or loading it from the store
    prefix_source: str  # "computed" or "loaded"
    prefix_tokens: int
    device: str
    dtype: str
    model: str = ""  # the model used, as given
    rescored: Optional[tuple[int, int, float]] = None  # --exact: (re-scored in float32, scored, gap bound)
    shard: Optional[tuple[int, int]] = None  # (k, n), 0-based k
    kept: int = 0  # --update: records kept from the output for items that did not change
    dropped: int = 0  # --update: records of items no longer in the input
    nothing_to_do: bool = False  # the output already held every item
    labels: Counter = field(default_factory=Counter)  # predictions written by this run, by label
    merged: Optional[int] = None  # records joined from the processes of a launch (its rank 0)
    processes: int = 1
    evaluation: Optional[Evaluation] = None
    gates: Gates = Gates()

    @property
    def gate_failures(self) -> list[str]:
        return self.evaluation.gate_failures(self.gates) if self.evaluation else []

    @property
    def gate_failed(self) -> bool:
        return bool(self.gate_failures)

    @property
    def exit_code(self) -> int:
        return EXIT_GATE if self.gate_failed else EXIT_ITEM if self.stats.errors else EXIT_OK


def run_job(options: RunOptions, progress: Optional[Progress] = None, stop: Optional[Stop] = None) -> RunResult:
    started = time.perf_counter()
    plan = make_plan(options)
    if progress:
        progress(Event("checked", total=plan.total))
    device = str(plan.launched.device) if plan.launched and options.device == "auto" else options.device
    fingerprint = run_fingerprint(options, plan, pick_device(device))
    start = None
    if not plan.part:  # a shard's items are known once batches can be formed: after the model loads
        start = start_output(plan.output, fingerprint, options.resume, options.update, options.items)
        _in_input_order(start, options, plan)
        if _complete(start, plan):
            continue_output(plan.output, start, fingerprint)  # a damaged last line still goes
            return _nothing_to_do(start, plan, options)
    if progress:
        progress(Event("loading", detail="tokenizer"))
    task = Task.from_spec(plan.spec, options.cache_dir)
    for warning in lint_labels(task.builder) if plan.spec.labels else ():
        log.warning("%s", warning)
    if progress:
        progress(Event("loading", detail="model"))
    scorer = load_scorer(task, options, device)
    bounds = _bounds(task, scorer, options, plan)
    if plan.part:
        fingerprint.update(shard=f"{plan.part[0] + 1}/{plan.part[1]}", items=bounds[1] - bounds[0],
                           ids=ids_digest(id_text(item.id) for item in islice(
                               read_input(options, plan), *bounds)))
        start = start_output(plan.output, fingerprint, options.resume, options.update, options.items)
    result = RunResult(
        output=plan.output, stats=RunStats(), resumed=0 if start.mode == "update" else len(start.records),
        first_record=None, load_seconds=task.load_seconds + scorer.load_seconds,
        prefill_ms=scorer.prefix.prefill_ms, prefix_source=scorer.prefix_source,
        prefix_tokens=len(scorer.prefix.ids), device=scorer.device, dtype=scorer.dtype, shard=plan.part,
        model=task.source.ref,
        evaluation=evaluation_for(plan.spec, () if start.mode == "update" else start.records.values()),
        gates=gates_of(options),
    )
    _write(scorer, options, plan, bounds, start, fingerprint, result, progress, stop, started)
    if hasattr(scorer, "rescored"):
        result.rescored = (scorer.rescored, scorer.checked, scorer.bound or 0.0)
    if plan.launched:
        _join_launch(result, plan, options)
    if result.evaluation:
        write_reports(result.evaluation, options.metrics, options.summary_md, options.junit, result.gates,
                      result.stats.seconds)
    return result


def _in_input_order(start: Start, options: RunOptions, plan: Plan) -> None:
    """An output being continued holds the first items of its input, in order (records are only
    ever appended); anything else was changed after it was written, and appending would mix."""
    if start.mode not in ("resume", "grown") or is_stream(options.items) or not start.records:
        return
    items = islice(read_input(options, plan), len(start.records))
    for n, (item, key) in enumerate(zip(items, start.records), 1):
        if id_text(item.id) != key:
            raise OutputError(f"{plan.output}: record {n} is item {key!r}, but item {n} of {options.items} is "
                              f"{item.id!r}; the output was changed after it was written: --update rewrites it")


def _complete(start: Start, plan: Plan) -> bool:
    """A resumed output that already holds a record for every item of the same input (its
    records are the input's first items in order: `_in_input_order` checked that)."""
    return start.mode == "resume" and plan.total is not None and len(start.records) >= plan.total


def _nothing_to_do(start: Start, plan: Plan, options: RunOptions) -> RunResult:
    result = RunResult(
        output=plan.output, stats=RunStats(), resumed=len(start.records), first_record=None, load_seconds=0.0,
        prefill_ms=0.0, prefix_source="", prefix_tokens=0, device="", dtype="", nothing_to_do=True,
        evaluation=evaluation_for(plan.spec, start.records.values()), gates=gates_of(options),
    )
    if result.evaluation:
        write_reports(result.evaluation, options.metrics, options.summary_md, options.junit, result.gates)
    return result


def load_scorer(task: Task, options: RunOptions, device: str) -> Any:
    from ..scoring.exact import CheckedScorer
    from ..scoring.scorer import Scorer  # the torch side: imported once a model is needed
    from ..model.store import PrefixStore

    store = None
    if options.cache_store:
        root = options.cache_dir / "prefixes"
        store = PrefixStore(root) if options.store_max_bytes is None else PrefixStore(root, options.store_max_bytes)
    if options.exact and not compat.bf16_matmul(pick_device(device)):
        log.warning("this %s has no bfloat16 matrix instructions, so --exact would gain nothing: scoring in float32",
                    pick_device(device))
    elif options.exact:
        return CheckedScorer.pair(task, options.cache_dir, device, options.dtype, store)
    scorer = Scorer.load(task, options.cache_dir, device, "float32" if options.exact else options.dtype, store)
    scorer.says_precision = options.exact
    return scorer


def _bounds(task: Task, scorer: Any, options: RunOptions, plan: Plan) -> tuple[int, Optional[int]]:
    """The items this process scores: all (up to --limit), or its shard's whole batches, so
    every shard forms the batches one process would."""
    if not plan.part:
        return 0, plan.total if plan.total is not None else options.limit
    items = islice(read_input(options, plan), plan.total)
    starts = task.batch_starts(items, batching_of(options), scorer.context) + [plan.total]
    first, last = shard_range(len(starts) - 1, *plan.part)
    return starts[first], starts[last]


def _write(scorer: Any, options: RunOptions, plan: Plan, bounds: tuple[int, Optional[int]], start: Start,
           fingerprint: dict[str, Any], result: RunResult, progress: Optional[Progress], stop: Optional[Stop],
           started: float) -> None:
    """Score the items and write their records. A fresh or resumed output is appended to; an
    updated one is written aside and replaces the old one only when complete."""
    path = plan.output
    if start.mode == "update":
        path = _aside(plan.output)
    elif start.mode != "fresh":
        continue_output(plan.output, start, fingerprint)
        log.info("%s: %d records already written; resuming", plan.output, len(start.records))
    writer = open_writer(path, columns(plan.spec, plan.keep or (), precision=options.exact),
                         append=start.mode in ("resume", "grown"),
                         fmt=plan.output_format, id_column=plan.spec.id_field if plan.spec.id_field_given else "id")
    if start.mode == "fresh" and path not in (None, "-"):
        write_fingerprint(path, fingerprint)
    try:
        for record in _records(scorer, options, plan, bounds, start, result, progress, stop):
            writer.write(record)
            result.labels[_label_of(record)] += 1
            result.first_record = result.first_record or time.perf_counter() - started
            if result.evaluation:
                add_record(result.evaluation, record)
    except BaseException:
        writer.close()
        if start.mode == "update":
            Path(path).unlink(missing_ok=True)  # the output stays as it was
        raise
    writer.close()
    if start.mode == "update":
        os.replace(path, plan.output)
        write_fingerprint(plan.output, fingerprint)


def _label_of(record: Record) -> str:
    return "(error)" if is_error(record) else "(abstained)" if record["label"] is None else str(record["label"])


def _aside(output: str) -> str:
    """A new, unpredictable file next to `output`, to be renamed over it."""
    target = Path(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    os.chmod(tmp, default_mode())  # the replaced output keeps the mode a new output would have
    return tmp


def _records(scorer: Any, options: RunOptions, plan: Plan, bounds: tuple[int, Optional[int]], start: Start,
             result: RunResult, progress: Optional[Progress], stop: Optional[Stop]) -> Iterator[Record]:
    """The records to write, in input order: for a fresh or resumed output those not written yet;
    for an update, every item's (an unchanged item's kept record, a new or changed item's fresh one)."""
    first, last = bounds
    stats, updating = result.stats, start.mode == "update"
    done = {} if updating else start.records
    left = None if last is None else max(last - first - len(done), 0)

    def after_batch(n: int) -> None:
        log.debug("batch: %d records, %d written, %.1f items/s", n, stats.items, stats.items_per_second)
        if progress:
            progress(Event("batch", stats.items, left, stats.items_per_second))
        signum = stop() if stop else None
        if signum:
            raise _interrupted(signum, stats.items, options, updating)

    if progress:
        progress(Event("scoring", 0, left, detail=(
            f"spec {options.spec}, input {options.items}, output {plan.output or 'stdout'}, model "
            f"{scorer.task.source.ref}, {scorer.device} {scorer.dtype}, prefix {len(scorer.prefix.ids)} tokens "
            f"{scorer.prefix_source}{', ' + str(len(done)) + ' records already written' if done else ''}")))
    items = islice(read_input(options, plan), first, last)
    if is_stream(options.items):  # read once, never scanned: check it as it streams
        items = _checked_stream(items, options.items, {} if updating else start.records)
    if not updating:
        yield from classify(scorer, items, batching_of(options), stats, done, after_batch, plan.keep)
        return
    order: deque = deque()  # per item in input order: its kept record, or None when it is scored
    gone = set(start.records)

    def changed() -> Iterator[Item]:
        for item in items:
            gone.discard(id_text(item.id))
            old = start.records.get(id_text(item.id))
            kept = old is not None and old.get("item_sha") == item_sha(item.record)
            order.append(old if kept else None)
            result.kept += kept
            if not kept:
                yield item

    for record in classify(scorer, changed(), batching_of(options), stats, None, after_batch, plan.keep):
        while order[0] is not None:
            yield order.popleft()
        order.popleft()
        yield record
    yield from order
    result.dropped = len(gone)


def _checked_stream(items: Iterator[Item], name: str, written: Mapping[str, Record]) -> Iterator[Item]:
    """What the scan before the run checks for a file, for input that can be read only once:
    unique ids; and, when continuing an output, that an item already written is the same item."""
    seen: dict[str, int] = {}
    label = "<stdin>" if name == "-" else name
    for item in items:
        key = id_text(item.id)
        if key in seen:
            raise InputError(f"{label}:{item.line}: duplicate id {item.id!r} (first on line {seen[key]})")
        seen[key] = item.line
        old = written.get(key)
        if old is not None and old.get("item_sha") not in (None, item_sha(item.record)):
            raise InputError(f"{label}:{item.line}: item {item.id!r} differs from the one already written to the "
                             f"output; this is not the input the output was started with")
        yield item


def _interrupted(signum: int, written: int, options: RunOptions, updating: bool) -> Interrupted:
    name, output = signal.Signals(signum).name, options.output
    if output in (None, "-"):
        return Interrupted(signum, f"interrupted by {name}: {written} records written")
    if updating:
        return Interrupted(signum, f"interrupted by {name}: {output} is unchanged; update it with: {command_line(options)}")
    return Interrupted(signum, f"interrupted by {name}: {written} records written to {output}; "
                               f"resume with: {command_line(options)}")


def _join_launch(result: RunResult, plan: Plan, options: RunOptions) -> None:
    """After every process of a launch wrote its part: rank 0 joins them into the output and
    evaluates the whole; the other ranks report nothing."""
    result.processes = plan.launched.num_processes
    result.merged = merge_launched(plan.launched, options.output)
    result.output = options.output
    if result.merged is None:
        result.evaluation = None
    elif result.evaluation is not None:
        result.evaluation = evaluation_for(plan.spec, read_records(options.output).records)


