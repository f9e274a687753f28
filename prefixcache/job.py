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

import dataclasses
import logging
import os
import shlex
import signal
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from . import compat
from .errors import EXIT_GATE, EXIT_ITEM, EXIT_OK, InputError, Interrupted, OutputError, SpecError, UsageError
from .io import Item, detect_format, is_stream, read_items, scan_items
from .lint import lint_labels
from .load import default_cache_dir, model_identity, pick_device, pick_dtype, spec_model
from .metrics import Evaluation, Gates, add_record, evaluation_for, write_reports
from .output import Start, check_output, check_report, continue_output, default_mode, file_digest, start_output, write_fingerprint
from .records import (
    Keep, Record, columns, id_text, ids_digest, is_error, item_sha, keep_clash, open_writer, output_format, read_records,
)
from .run import RunStats, classify
from .shard import launch_state, merge_launched, parse_shard, part_path, shard_range
from .spec import TaskSpec, load_spec
from .rows import trie
from .task import Batching, Prepared, Task

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


@dataclass(frozen=True)
class RunOptions:
    """Everything a run takes (the `run` command's options)."""

    spec: Path
    items: str  # a file, or "-" for stdin
    output: Optional[str] = None  # .jsonl or .csv; None or "-": JSONL on stdout
    input_format: Optional[str] = None  # jsonl, csv, tsv, json or parquet when the extension does not tell
    delimiter: Optional[str] = None  # CSV/TSV field separator
    encoding: Optional[str] = None  # CSV/TSV text encoding (default UTF-8, with or without a BOM)
    resume: bool = False  # continue the output: the same input, or the same input grown
    update: bool = False  # continue the output whatever the input: keep unchanged items' records
    overwrite: bool = False
    on_error: str = "fail"  # or "skip": error records
    batch_size: int = 64
    batch_tokens: int = 768
    limit: Optional[int] = None
    gold: Optional[str] = None  # overrides the spec's gold field
    keep: tuple[str, ...] = ()  # input fields to copy into each record
    keep_all: bool = False  # copy every input field
    output_format: Optional[str] = None  # jsonl or csv when the output's extension does not tell (stdout)
    model: Optional[str] = None  # overrides the spec's model (hub id, folder or .gguf file)
    revision: Optional[str] = None  # overrides the spec's revision (hub models)
    metrics: Optional[Path] = None
    summary_md: Optional[Path] = None
    junit: Optional[Path] = None
    min_accuracy: Optional[float] = None
    min_recall: Optional[float] = None  # every label's recall
    device: str = "auto"
    dtype: str = "auto"
    exact: bool = False  # low-precision dtype, close calls re-scored in float32
    cache_dir: Path = field(default_factory=default_cache_dir)
    cache_store: bool = True  # load and keep prefilled prefixes under cache_dir
    store_max_bytes: Optional[int] = None  # None: the store's default bound
    shard: Optional[str] = None  # "K/N"


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


@dataclass(frozen=True)
class _Plan:
    """What the checks before any model settle."""

    spec: TaskSpec
    input_format: str
    total: Optional[int]  # items to consider (after --limit); None for stdin
    output: Optional[str]  # where this process writes (a part file in a launch)
    part: Optional[tuple[int, int]]
    launched: Any  # accelerate's state of a multi-process launch, or None
    output_format: str = "jsonl"
    keep: Keep = ()  # input fields copied into each record (None: all)


def run_job(options: RunOptions, progress: Optional[Progress] = None, stop: Optional[Stop] = None) -> RunResult:
    started = time.perf_counter()
    plan = _plan(options)
    if progress:
        progress(Event("checked", total=plan.total))
    device = str(plan.launched.device) if plan.launched and options.device == "auto" else options.device
    fingerprint = _fingerprint(options, plan, pick_device(device))
    start = None
    if not plan.part:  # a shard's items are known once batches can be formed: after the model loads
        start = start_output(plan.output, fingerprint, options.resume, options.update, options.items)
        _in_input_order(start, options, plan)
        if _complete(start, options, plan):
            continue_output(plan.output, start, fingerprint)  # a damaged last line still goes
            return _nothing_to_do(start, plan, options)
    if progress:
        progress(Event("loading", detail="tokenizer"))
    task = Task.from_spec(plan.spec, options.cache_dir)
    for warning in lint_labels(task.builder) if plan.spec.labels else ():
        log.warning("%s", warning)
    if progress:
        progress(Event("loading", detail="model"))
    scorer = _load_scorer(task, options, device)
    bounds = _bounds(task, scorer, options, plan)
    if plan.part:
        fingerprint.update(shard=f"{plan.part[0] + 1}/{plan.part[1]}", items=bounds[1] - bounds[0],
                           ids=ids_digest(id_text(item.id) for item in islice(
                               _read(options, plan), *bounds)))
        start = start_output(plan.output, fingerprint, options.resume, options.update, options.items)
    result = RunResult(
        output=plan.output, stats=RunStats(), resumed=0 if start.mode == "update" else len(start.records),
        first_record=None, load_seconds=task.load_seconds + scorer.load_seconds,
        prefill_ms=scorer.prefix.prefill_ms, prefix_source=scorer.prefix_source,
        prefix_tokens=len(scorer.prefix.ids), device=scorer.device, dtype=scorer.dtype, shard=plan.part,
        model=task.source.ref,
        evaluation=evaluation_for(plan.spec, () if start.mode == "update" else start.records.values()),
        gates=_gates(options),
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


def with_overrides(spec: TaskSpec, gold: Optional[str] = None, model: Optional[str] = None,
                   revision: Optional[str] = None) -> TaskSpec:
    """The spec with what the command line (or environment) sets instead. A model given there is
    a path relative to the current folder, not the spec's."""
    if gold:
        spec = dataclasses.replace(spec, gold=gold)
    if model:
        spec = dataclasses.replace(spec, model=str(Path(model).expanduser().absolute()) if Path(model).exists() else model)
    if revision:
        spec = dataclasses.replace(spec, revision=revision)
    return spec


def _gates(options: RunOptions) -> Gates:
    return Gates(options.min_accuracy, options.min_recall)


def _plan(options: RunOptions) -> _Plan:
    """Every check that needs no model: a mistake costs a second, not a model load."""
    if options.on_error not in ("fail", "skip"):
        raise UsageError(f"--on-error must be fail or skip, not {options.on_error!r}")
    if (options.resume or options.update) and options.output in (None, "-"):
        raise OutputError(f"{'--update' if options.update else '--resume'} needs an output file (-o)")
    if options.overwrite and (options.resume or options.update):
        raise OutputError(f"--overwrite starts the output again; {'--update' if options.update else '--resume'} "
                          f"continues it: give one of them")
    launched = launch_state(cpu=options.device == "cpu")
    part = parse_shard(options.shard) if options.shard else None
    if launched:
        part = (launched.process_index, launched.num_processes)
    if part and (is_stream(options.items) or options.output in (None, "-")):
        raise OutputError("sharded and multi-process runs need an input file and an output file (-o)")
    _not_the_input(options)
    spec = with_overrides(load_spec(options.spec), options.gold, options.model, options.revision)
    if options.exact and options.dtype not in ("bfloat16", "float16"):
        raise UsageError("--exact re-scores the close calls of a bfloat16 or float16 run in float32: "
                         "give --dtype bfloat16 (or float16)")
    reports = options.metrics or options.summary_md or options.junit or _gates(options) != Gates()
    if reports and not spec.gold:
        raise SpecError("--metrics, --summary-md, --junit, --min-accuracy and --min-recall need a gold field "
                        "('gold' in the spec, or --gold)")
    fmt = detect_format(options.items, options.input_format)
    total, fields = None, {}
    if not is_stream(options.items):  # validate the whole input before the model loads
        check = spec.check_record if options.on_error == "fail" else (lambda record: None)
        total = scan_items(options.items, fmt, spec.id_field, check, spec.id_field_given, fields, options.delimiter,
                           options.encoding)
        total = min(total, options.limit) if options.limit else total
    out_fmt = output_format(options.output, options.output_format)
    kept = _keep(options, spec, fields, out_fmt)
    keep = options.resume or options.update
    check_output(options.output, keep, options.overwrite)
    for report in (options.metrics, options.summary_md, options.junit):
        check_report(report)
    output = options.output
    if launched:
        output = part_path(options.output, *part)
        check_output(output, keep, options.overwrite)
    return _Plan(spec, fmt, total, output, part, launched, out_fmt, kept)


def _read(options: RunOptions, plan: _Plan) -> Iterator[Item]:
    return read_items(options.items, plan.input_format, plan.spec.id_field, options.delimiter, options.encoding)


def _keep(options: RunOptions, spec: TaskSpec, fields: dict[str, None], out_fmt: str) -> Keep:
    """The input fields each record carries: those named with --keep, or with --keep-all every
    field the input has (None for a stream written as JSONL: each item's own)."""
    if options.keep and options.keep_all:
        raise UsageError("give --keep FIELD,... or --keep-all, not both")
    if options.keep_all and is_stream(options.items):
        if out_fmt == "csv":
            raise UsageError("--keep-all with CSV output needs the columns before the first row: name them with --keep "
                             "(input read once is not scanned)")
        return None
    names = list(fields) if options.keep_all else list(dict.fromkeys(options.keep))
    names = [name for name in names if name != spec.id_field]  # the id is there already
    for name in names:
        clash = keep_clash(spec, name)
        if clash:
            raise UsageError(f"cannot keep input field {name!r}: {clash}; rename it in the input")
        if fields and name not in fields:
            raise UsageError(f"--keep {name}: no item has this field; the items' fields are "
                             f"{', '.join(map(repr, fields))}")
    return tuple(names)


def _not_the_input(options: RunOptions) -> None:
    """Writing the output must never destroy the input (the same file, a link to it included)."""
    if is_stream(options.items) or options.output in (None, "-"):
        return
    try:
        same = Path(options.output).exists() and Path(options.output).samefile(options.items)
    except OSError:
        same = False
    if same:
        raise OutputError(f"{options.output}: is the input file {options.items}; write the output to another file")


def _fingerprint(options: RunOptions, plan: _Plan, device: str) -> dict[str, Any]:
    """What an output file is tied to: continuing it with any of it changed is refused (the input
    may grow, or with --update change)."""
    source = spec_model(plan.spec)
    return {
        "spec": file_digest(str(options.spec)), "gold": plan.spec.gold, "model": model_identity(source),
        "input": file_digest(options.items), "input_bytes": _size(options.items), "device": device.split(":")[0],
        "dtype": str(pick_dtype(options.dtype, device)).removeprefix("torch."),
        "batch_size": options.batch_size, "batch_tokens": options.batch_tokens,
        "keep": "all" if plan.keep is None else list(plan.keep), "exact": options.exact,
    }


def _size(path: str) -> Optional[int]:
    return None if is_stream(path) else os.path.getsize(path)


def _in_input_order(start: Start, options: RunOptions, plan: _Plan) -> None:
    """An output being continued holds the first items of its input, in order (records are only
    ever appended); anything else was changed after it was written, and appending would mix."""
    if start.mode not in ("resume", "grown") or is_stream(options.items) or not start.records:
        return
    items = islice(_read(options, plan), len(start.records))
    for n, (item, key) in enumerate(zip(items, start.records), 1):
        if id_text(item.id) != key:
            raise OutputError(f"{plan.output}: record {n} is item {key!r}, but item {n} of {options.items} is "
                              f"{item.id!r}; the output was changed after it was written: --update rewrites it")


def _complete(start: Start, options: RunOptions, plan: _Plan) -> bool:
    """A resumed output that already holds a record for every item (of the same input)."""
    if start.mode != "resume" or plan.total is None or len(start.records) < plan.total:
        return False
    items = islice(_read(options, plan), plan.total)
    return all(id_text(item.id) in start.records for item in items)


def _nothing_to_do(start: Start, plan: _Plan, options: RunOptions) -> RunResult:
    result = RunResult(
        output=plan.output, stats=RunStats(), resumed=len(start.records), first_record=None, load_seconds=0.0,
        prefill_ms=0.0, prefix_source="", prefix_tokens=0, device="", dtype="", nothing_to_do=True,
        evaluation=evaluation_for(plan.spec, start.records.values()), gates=_gates(options),
    )
    if result.evaluation:
        write_reports(result.evaluation, options.metrics, options.summary_md, options.junit, result.gates)
    return result


def _load_scorer(task: Task, options: RunOptions, device: str) -> Any:
    from .scorer import Scorer  # the torch side: imported once a model is needed
    from .store import PrefixStore

    from .exact import CheckedScorer

    store = None
    if options.cache_store:
        root = options.cache_dir / "prefixes"
        store = PrefixStore(root) if options.store_max_bytes is None else PrefixStore(root, options.store_max_bytes)
    if options.exact and _fast_kind(options, device) == "float32":
        log.warning("this %s has no bfloat16 matrix instructions, so --exact would gain nothing: scoring in float32",
                    pick_device(device))
    elif options.exact:
        return CheckedScorer.pair(task, options.cache_dir, device, options.dtype, store)
    scorer = Scorer.load(task, options.cache_dir, device, "float32" if options.exact else options.dtype, store)
    scorer.says_precision = options.exact
    return scorer


def _fast_kind(options: RunOptions, device: str) -> str:
    """The dtype the low-precision pass of --exact runs in: the one asked for, or float32 where
    the hardware has no fast bfloat16 matmul."""
    return options.dtype if compat.bf16_matmul(pick_device(device)) else "float32"


def _bounds(task: Task, scorer: Any, options: RunOptions, plan: _Plan) -> tuple[int, Optional[int]]:
    """The items this process scores: all (up to --limit), or its shard's whole batches, so
    every shard forms the batches one process would."""
    if not plan.part:
        return 0, plan.total if plan.total is not None else options.limit
    items = islice(_read(options, plan), plan.total)
    starts = task.batch_starts(items, _batching(options), scorer.context) + [plan.total]
    first, last = shard_range(len(starts) - 1, *plan.part)
    return starts[first], starts[last]


def _batching(options: RunOptions) -> Batching:
    return Batching(options.batch_size, options.batch_tokens, options.on_error)


def _write(scorer: Any, options: RunOptions, plan: _Plan, bounds: tuple[int, Optional[int]], start: Start,
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


def _records(scorer: Any, options: RunOptions, plan: _Plan, bounds: tuple[int, Optional[int]], start: Start,
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
    items = islice(_read(options, plan), first, last)
    if is_stream(options.items):  # read once, never scanned: check it as it streams
        items = _checked_stream(items, options.items, {} if updating else start.records)
    if not updating:
        yield from classify(scorer, items, _batching(options), stats, done, after_batch, plan.keep)
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

    for record in classify(scorer, changed(), _batching(options), stats, None, after_batch, plan.keep):
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


def command_line(options: RunOptions) -> str:
    """The `prefixcache run` command that continues this run: its arguments and every option that
    is not at its default (whether it came from the command line or the environment)."""
    default = RunOptions(options.spec, options.items)
    flags = {"output": "-o", "input_format": "--format", "on_error": "--on-error", "batch_size": "--batch-size",
             "batch_tokens": "--batch-tokens", "limit": "--limit", "gold": "--gold", "metrics": "--metrics",
             "summary_md": "--summary-md", "junit": "--junit", "min_accuracy": "--min-accuracy", "min_recall": "--min-recall", "model": "--model", "revision": "--revision",
             "output_format": "--output-format", "exact": "--exact", "delimiter": "--delimiter", "encoding": "--encoding",
             "device": "--device", "dtype": "--dtype", "cache_dir": "--cache-dir", "shard": "--shard"}
    words = ["prefixcache", "run", str(options.spec), options.items]
    for name, flag in flags.items():
        value = getattr(options, name)
        if value is not None and value != getattr(default, name):
            words += [flag] if value is True else [flag, str(value)]
    if options.keep:
        words += ["--keep", ",".join(options.keep)]
    if options.keep_all:
        words.append("--keep-all")
    if not options.cache_store:
        words.append("--no-cache-store")
    words.append("--update" if options.update else "--resume")
    return shlex.join(words)


def _interrupted(signum: int, written: int, options: RunOptions, updating: bool) -> Interrupted:
    name, output = signal.Signals(signum).name, options.output
    if output in (None, "-"):
        return Interrupted(signum, f"interrupted by {name}: {written} records written")
    if updating:
        return Interrupted(signum, f"interrupted by {name}: {output} is unchanged; update it with: {command_line(options)}")
    return Interrupted(signum, f"interrupted by {name}: {written} records written to {output}; "
                               f"resume with: {command_line(options)}")


def _join_launch(result: RunResult, plan: _Plan, options: RunOptions) -> None:
    """After every process of a launch wrote its part: rank 0 joins them into the output and
    evaluates the whole; the other ranks report nothing."""
    result.processes = plan.launched.num_processes
    result.merged = merge_launched(plan.launched, options.output)
    result.output = options.output
    if result.merged is None:
        result.evaluation = None
    elif result.evaluation is not None:
        result.evaluation = evaluation_for(plan.spec, read_records(options.output).records)


@dataclass
class DryRun:
    """What a run would do, measured without writing anything."""

    prefix_tokens: int
    items: list[dict[str, Any]]  # per item: id, item_tokens (its own, after the cached prefix), label_tokens
    failed: int  # items that could not be scored (with on_error="skip")
    measured: int  # items scored to time the run
    ms_per_item: float
    load_seconds: float

    @property
    def item_tokens(self) -> int:
        return sum(i["item_tokens"] for i in self.items)

    @property
    def label_tokens(self) -> int:
        return sum(i["label_tokens"] for i in self.items)

    @property
    def estimate_seconds(self) -> float:
        return self.ms_per_item * len(self.items) / 1000


def dry_run(options: RunOptions, measure: int = 16, progress: Optional[Progress] = None) -> DryRun:
    """Check the spec and the input, count every item's tokens, and time the first `measure`
    items through the model (nothing is written)."""
    plan = _plan(options)
    if progress:
        progress(Event("checked", total=plan.total))
        progress(Event("loading", detail="tokenizer"))
    task = Task.from_spec(plan.spec, options.cache_dir)
    items, failed = [], 0
    for batch in task.batches(islice(_read(options, plan), *_bounds_without_model(options, plan)), _batching(options)):
        for entry in batch:
            if not isinstance(entry, Prepared):
                failed += 1
                continue
            items.append({"id": entry.item.id, "item_tokens": entry.own_tokens,
                          "label_tokens": len(trie(list(entry.candidates.values())))})
    if progress:
        progress(Event("loading", detail="model"))
    scorer = _load_scorer(task, options, options.device)
    stats = RunStats()
    sample = islice(_read(options, plan), min(measure, len(items)) if items else 0)
    for _ in classify(scorer, sample, _batching(options), stats):
        pass
    return DryRun(len(scorer.prefix.ids), items, failed, stats.items, stats.ms_per_item,
                  task.load_seconds + scorer.load_seconds)


def _bounds_without_model(options: RunOptions, plan: _Plan) -> tuple[int, Optional[int]]:
    return 0, plan.total if plan.total is not None else options.limit
