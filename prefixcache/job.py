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
import signal
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import EXIT_GATE, EXIT_ITEM, EXIT_OK, Interrupted, OutputError, SpecError
from .io import detect_format, read_items, scan_items
from .lint import lint_labels
from .load import default_cache_dir, model_identity, pick_device, pick_dtype
from .metrics import Evaluation, evaluation_for, write_reports
from .output import check_output, file_digest, start_output
from .records import columns, is_error, open_writer, read_records
from .run import RunStats, classify
from .shard import launch_state, merge_launched, parse_shard, part_path, shard_range
from .spec import TaskSpec, load_spec
from .task import Batching, Task

log = logging.getLogger("prefixcache")



@dataclass(frozen=True)
class Event:
    """What `run_job` reports as it goes. phase: "checked" (spec, input and output are valid; no
    model loaded yet), "scoring" (records are about to stream), "batch" (a batch was written)."""

    phase: str
    written: int = 0  # records written by this run so far
    total: Optional[int] = None  # records this run will write (None when reading stdin)
    rate: float = 0.0  # items per second of scoring


Progress = Callable[[Event], None]
Stop = Callable[[], Optional[int]]  # the signal number that asks the run to stop, or None


@dataclass(frozen=True)
class RunOptions:
    """Everything a run takes (the `run` command's options)."""

    spec: Path
    items: str  # a file, or "-" for stdin
    output: Optional[str] = None  # .jsonl or .csv; None or "-": JSONL on stdout
    input_format: Optional[str] = None  # jsonl or csv when the extension does not tell
    resume: bool = False
    overwrite: bool = False
    on_error: str = "fail"  # or "skip": error records
    batch_size: int = 64
    batch_tokens: int = 768
    limit: Optional[int] = None
    gold: Optional[str] = None  # overrides the spec's gold field
    metrics: Optional[Path] = None
    summary_md: Optional[Path] = None
    junit: Optional[Path] = None
    min_accuracy: Optional[float] = None
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: Path = field(default_factory=default_cache_dir)
    cache_store: bool = True  # load and keep prefilled prefixes under cache_dir
    store_max_bytes: Optional[int] = None  # None: the store's default bound
    shard: Optional[str] = None  # "K/N"


@dataclass
class RunResult:
    """What a run did. `exit_code`: 0, EXIT_GATE when accuracy missed `min_accuracy`, or
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
    shard: Optional[tuple[int, int]] = None  # (k, n), 0-based k
    merged: Optional[int] = None  # records joined from the processes of a launch (its rank 0)
    processes: int = 1
    evaluation: Optional[Evaluation] = None
    min_accuracy: Optional[float] = None

    @property
    def gate_failed(self) -> bool:
        return bool(self.evaluation) and self.min_accuracy is not None and self.evaluation.accuracy < self.min_accuracy

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


def run_job(options: RunOptions, progress: Optional[Progress] = None, stop: Optional[Stop] = None) -> RunResult:
    started = time.perf_counter()
    plan = _plan(options)
    if progress:
        progress(Event("checked", total=plan.total))
    task = Task.from_spec(plan.spec, options.cache_dir)
    for warning in lint_labels(task.builder) if plan.spec.labels else ():
        log.warning("%s", warning)
    device = options.device
    if plan.launched and device == "auto":
        device = str(plan.launched.device)  # accelerate's placement: cuda:<local rank>, or cpu
    fingerprint = _fingerprint(options, plan, task, pick_device(device))
    scorer = _load_scorer(task, options, device)
    first, last = _bounds(task, scorer, options, plan)
    if plan.part:
        fingerprint.update(shard=f"{plan.part[0] + 1}/{plan.part[1]}", items=last - first)
    done = start_output(plan.output, options.resume, fingerprint)
    evaluation = evaluation_for(plan.spec, done.values())
    stats = RunStats()
    first_record = _stream(scorer, options, plan, (first, last), done, stats, evaluation, progress, stop, started)
    result = RunResult(
        output=plan.output, stats=stats, resumed=len(done), first_record=first_record,
        load_seconds=task.load_seconds + scorer.load_seconds, prefill_ms=scorer.prefix.prefill_ms,
        prefix_source=scorer.prefix_source, prefix_tokens=len(scorer.prefix.ids), device=scorer.device,
        dtype=scorer.dtype, shard=plan.part, evaluation=evaluation, min_accuracy=options.min_accuracy,
    )
    if plan.launched:
        _join_launch(result, plan, options)
    if result.evaluation:
        write_reports(result.evaluation, options.metrics, options.summary_md, options.junit, options.min_accuracy)
    return result


def _plan(options: RunOptions) -> _Plan:
    """Every check that needs no model: a mistake costs a second, not a model load."""
    if options.on_error not in ("fail", "skip"):
        raise SpecError(f"--on-error must be fail or skip, not {options.on_error!r}")
    if options.resume and options.output in (None, "-"):
        raise OutputError("--resume needs an output file (-o)")
    launched = launch_state(cpu=options.device == "cpu")
    part = parse_shard(options.shard) if options.shard else None
    if launched:
        part = (launched.process_index, launched.num_processes)
    if part and (options.items == "-" or options.output in (None, "-")):
        raise OutputError("sharded and multi-process runs need an input file and an output file (-o)")
    spec = load_spec(options.spec)
    if options.gold:
        spec = dataclasses.replace(spec, gold=options.gold)
    reports = options.metrics or options.summary_md or options.junit or options.min_accuracy is not None
    if reports and not spec.gold:
        raise SpecError("--metrics, --summary-md, --junit and --min-accuracy need a gold field ('gold' in the spec, or --gold)")
    fmt = detect_format(options.items, options.input_format)
    total = None
    if options.items != "-":  # validate the whole input before the model loads
        check = spec.check_record if options.on_error == "fail" else (lambda record: None)
        total = scan_items(options.items, fmt, spec.id_field, check)
        total = min(total, options.limit) if options.limit else total
    check_output(options.output, options.resume, options.overwrite)
    output = options.output
    if launched:
        output = part_path(options.output, *part)
        check_output(output, options.resume, options.overwrite)
    return _Plan(spec, fmt, total, output, part, launched)


def _fingerprint(options: RunOptions, plan: _Plan, task: Task, device: str) -> dict[str, Any]:
    """What an output file is tied to: a resume with any of it changed is refused."""
    return {
        "spec": file_digest(str(options.spec)), "gold": plan.spec.gold, "model": model_identity(task.source),
        "input": file_digest(options.items), "device": device.split(":")[0],
        "dtype": str(pick_dtype(options.dtype, device)).removeprefix("torch."),
    }


def _load_scorer(task: Task, options: RunOptions, device: str) -> Any:
    from .scorer import Scorer  # the torch side: imported once a model is needed
    from .store import PrefixStore

    store = None
    if options.cache_store:
        root = options.cache_dir / "prefixes"
        store = PrefixStore(root) if options.store_max_bytes is None else PrefixStore(root, options.store_max_bytes)
    return Scorer.load(task, options.cache_dir, device, options.dtype, store)


def _bounds(task: Task, scorer: Any, options: RunOptions, plan: _Plan) -> tuple[int, Optional[int]]:
    """The items this process scores: all (up to --limit), or its shard's whole batches, so
    every shard forms the batches one process would."""
    if not plan.part:
        return 0, plan.total
    items = islice(read_items(options.items, plan.input_format, plan.spec.id_field), plan.total)
    starts = task.batch_starts(items, _batching(options), scorer.context) + [plan.total]
    first, last = shard_range(len(starts) - 1, *plan.part)
    return starts[first], starts[last]


def _batching(options: RunOptions) -> Batching:
    return Batching(options.batch_size, options.batch_tokens, options.on_error)


def _stream(scorer: Any, options: RunOptions, plan: _Plan, bounds: tuple[int, Optional[int]], done: dict,
            stats: RunStats, evaluation: Optional[Evaluation], progress: Optional[Progress],
            stop: Optional[Stop], started: float) -> Optional[float]:
    """Score the items and write their records; returns when the first was written."""
    first, last = bounds
    left = None if last is None else max(last - first - len(done), 0)
    writer = open_writer(plan.output, columns(plan.spec), append=bool(done))
    first_record = None

    def after_batch(n: int) -> None:
        if progress:
            progress(Event("batch", stats.items, left, stats.items_per_second))
        signum = stop() if stop else None
        if signum:
            raise _interrupted(signum, stats.items, options)

    try:
        if progress:
            progress(Event("scoring", 0, left))
        items = islice(read_items(options.items, plan.input_format, plan.spec.id_field), first, last)
        for record in classify(scorer, items, _batching(options), stats, done, after_batch):
            writer.write(record)
            first_record = first_record or time.perf_counter() - started
            if evaluation and not is_error(record):
                evaluation.add(record["gold"], record["label"])
    finally:
        writer.close()
    return first_record


def _interrupted(signum: int, written: int, options: RunOptions) -> Interrupted:
    name = signal.Signals(signum).name
    output = options.output
    where = f" to {output}" if output and output != "-" else ""
    again = f"; resume with: prefixcache run {options.spec} {options.items} -o {output} --resume" if where else ""
    return Interrupted(signum, f"interrupted by {name}: {written} records written{where}{again}")


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
