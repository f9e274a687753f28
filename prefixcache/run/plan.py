"""The plan of a run: `RunOptions` (everything `run` takes) and every check that needs no model,
done before one loads: options, spec, the whole input, the output, the fields to keep, and the
fingerprint that ties an output to what wrote it. No torch here.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from ..errors import OutputError, SpecError, UsageError
from ..data.items import Item, detect_format, is_stream, read_items, scan_items
from ..model.load import default_cache_dir, model_identity, pick_dtype, spec_model
from ..reports.evaluation import Gates
from ..data.output import check_output, check_report, file_digest
from ..data.records import Keep, keep_clash, output_format
from .shards import launch_state, parse_shard, part_path
from ..task.spec import TaskSpec, load_spec
from ..scoring.prepare import Batching


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


@dataclass(frozen=True)
class Plan:
    """What the checks before any model settle."""

    spec: TaskSpec
    input_format: str
    total: Optional[int]  # items to consider (after --limit); None for stdin
    output: Optional[str]  # where this process writes (a part file in a launch)
    part: Optional[tuple[int, int]]
    launched: Any  # accelerate's state of a multi-process launch, or None
    output_format: str = "jsonl"
    keep: Keep = ()  # input fields copied into each record (None: all)


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


def gates_of(options: RunOptions) -> Gates:
    return Gates(options.min_accuracy, options.min_recall)


def make_plan(options: RunOptions) -> Plan:
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
    reports = options.metrics or options.summary_md or options.junit or gates_of(options) != Gates()
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
    return Plan(spec, fmt, total, output, part, launched, out_fmt, kept)


def read_input(options: RunOptions, plan: Plan) -> Iterator[Item]:
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


def run_fingerprint(options: RunOptions, plan: Plan, device: str) -> dict[str, Any]:
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


def batching_of(options: RunOptions) -> Batching:
    return Batching(options.batch_size, options.batch_tokens, options.on_error)


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
