"""The command line: parses options, turns library errors into one line and an exit code.

stdout carries data only (records, rendered prompts); progress, summaries and errors go to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import __version__
from .errors import EXIT_GATE, EXIT_INTERNAL, EXIT_ITEM, EXIT_USAGE, Interrupted, OutputError, PrefixcacheError, SpecError
from .io import detect_format, read_items, scan_items
from .output import check_output, open_writer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help=(
        "Classify batches of text with a local language model. The spec's static prompt prefix is "
        "encoded once and every item pays only for its own tokens.\n\n"
        "    prefixcache run configs/support-tickets.yaml data/samples/tickets.jsonl -o predictions.jsonl\n\n"
        "    prefixcache render configs/support-tickets.yaml data/samples/tickets.jsonl --limit 1"
    ),
)

err = Console(stderr=True, highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        print(f"prefixcache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
) -> None:
    """Classify batches of text with a local language model, encoding the static prompt prefix once."""


@contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """Library errors become `error: <message>` on stderr and their exit code; no traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except Interrupted as exc:
        err.print(str(exc), markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    except PrefixcacheError as exc:
        if debug:
            traceback.print_exc()
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        raise typer.Exit(130)
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (e.g. `| head`): not an error
        raise typer.Exit(0)
    except Exception as exc:
        if debug:
            traceback.print_exc()
        err.print(f"internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback)", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERNAL)


def _setup_logging(quiet: bool, level: str = "info") -> None:
    """Library log messages (a one-time model conversion, lint warnings) go to stderr, one line each."""
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
    if level.lower() not in levels:
        raise typer.BadParameter(f"--log-level must be one of {', '.join(levels)}")
    logger = logging.getLogger("prefixcache")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("prefixcache: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.ERROR if quiet else levels[level.lower()])


def _progress(quiet: bool) -> Progress:
    return Progress(
        TextColumn("classifying"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=err,
        disable=quiet or not err.is_terminal,
        transient=False,
    )


SPEC_ARG = typer.Argument(..., help="Task spec (YAML).", show_default=False)
ITEMS_ARG = typer.Argument(..., help="Items: a .jsonl or .csv file, or - for stdin (with --format).", show_default=False)
FORMAT_OPT = typer.Option(None, "--format", "-f", help="Input format when it cannot be told from the extension: jsonl or csv.")
LIMIT_OPT = typer.Option(None, "--limit", "-n", min=1, help="Process only the first N items.")
DEBUG_OPT = typer.Option(False, "--debug", help="Show a traceback for errors.")
CACHE_DIR_OPT = typer.Option(None, "--cache-dir", help="Where converted models and prefilled prefixes are kept (env PREFIXCACHE_CACHE_DIR; default ~/.cache/prefixcache).")


def _use_cache_dir(cache_dir: Optional[Path]) -> None:
    if cache_dir is not None:
        os.environ["PREFIXCACHE_CACHE_DIR"] = str(cache_dir)


def _store(cache_dir: Optional[Path] = None):
    from .load import cache_root
    from .store import DEFAULT_MAX_BYTES, PrefixStore

    _use_cache_dir(cache_dir)
    limit = os.environ.get("PREFIXCACHE_STORE_MAX_MB")
    try:
        max_bytes = int(float(limit) * 2**20) if limit else DEFAULT_MAX_BYTES
    except ValueError:
        raise SpecError(f"PREFIXCACHE_STORE_MAX_MB must be a number of megabytes, not {limit!r}")
    return PrefixStore(cache_root() / "prefixes", max_bytes)


@app.command()
def run(
    spec: Path = SPEC_ARG,
    items: str = ITEMS_ARG,
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output .jsonl or .csv; stdout (JSONL) when omitted."),
    fmt: Optional[str] = FORMAT_OPT,
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: keep its records, score the rest."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    on_error: str = typer.Option("fail", "--on-error", help="An item that cannot be scored: fail (stop after writing what is done) or skip (write an error record, go on)."),
    batch_size: int = typer.Option(64, "--batch-size", "-b", min=1, envvar="PREFIXCACHE_BATCH_SIZE", help="At most this many items per forward pass."),
    batch_tokens: int = typer.Option(768, "--batch-tokens", min=1, envvar="PREFIXCACHE_BATCH_TOKENS", help="About this many tokens per forward pass (items' own tokens + label tokens)."),
    limit: Optional[int] = LIMIT_OPT,
    gold: Optional[str] = typer.Option(None, "--gold", help="Item field with the expected label or option (overrides the spec's 'gold')."),
    metrics: Optional[Path] = typer.Option(None, "--metrics", help="Write the evaluation as JSON to this file."),
    summary_md: Optional[Path] = typer.Option(None, "--summary-md", help="Write the evaluation as Markdown (e.g. $GITHUB_STEP_SUMMARY)."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write the evaluation as a JUnit XML report."),
    min_accuracy: Optional[float] = typer.Option(None, "--min-accuracy", min=0.0, max=1.0, help=f"Exit with code {EXIT_GATE} when accuracy is below this."),
    device: str = typer.Option("auto", "--device", envvar="PREFIXCACHE_DEVICE", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", "--dtype", envvar="PREFIXCACHE_DTYPE", help="auto (float32 on CPU, bf16/fp16 on CUDA), float32, bfloat16, float16."),
    cache_dir: Optional[Path] = CACHE_DIR_OPT,
    no_cache_store: bool = typer.Option(False, "--no-cache-store", help="Neither load nor keep the prefilled prefix on disk."),
    shard: Optional[str] = typer.Option(None, "--shard", help="Run only shard K of N (K/N, 1-based), e.g. one CI matrix job; join the parts with `prefixcache merge`."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, summary, warnings or evaluation tables."),
    log_level: str = typer.Option("info", "--log-level", envvar="PREFIXCACHE_LOG_LEVEL", help="debug, info, warning or error (stderr)."),
    debug: bool = DEBUG_OPT,
) -> None:
    """Classify every item and stream one record per item, in input order.

    An existing output is refused unless `--resume` (keep its records, score the rest: safe to
    repeat after any crash) or `--overwrite`. Ctrl-C / SIGTERM finish the current batch, flush, and
    exit 130 / 143. With a gold field (spec key `gold` or `--gold`), accuracy, macro-F1, per-label
    precision/recall and a confusion matrix follow on stderr; `--min-accuracy` gates on them.

    Example:

        prefixcache run configs/support-tickets.yaml data/samples/tickets.jsonl -o predictions.jsonl

        prefixcache run spec.yaml items.jsonl -o out.jsonl --resume --on-error skip --quiet   # cron

        cat items.csv | prefixcache run spec.yaml - --format csv > predictions.jsonl

        prefixcache run configs/irony.yaml data/samples/irony.jsonl -o out.jsonl --min-accuracy 0.6 --junit report.xml
    """
    from .lint import lint_labels
    from .load import model_identity, pick_device, pick_dtype
    from .metrics import evaluation_for
    from .output import file_digest, start_output
    from .run import Classifier, flatten_for_csv, output_columns
    from .output import read_done
    from .report import print_summary
    from .shard import launch_state, merge_launched, parse_shard, part_path, shard_range
    from .spec import load_spec

    started = time.perf_counter()
    _setup_logging(quiet, log_level)
    _use_cache_dir(cache_dir)
    with _errors(debug):
        if on_error not in ("fail", "skip"):
            raise SpecError(f"--on-error must be fail or skip, not {on_error!r}")
        if resume and (output is None or output == "-"):
            raise OutputError("--resume needs an output file (-o)")
        launched = launch_state(cpu=device == "cpu")
        part = parse_shard(shard) if shard else None
        if launched:
            part = (launched.process_index, launched.num_processes)
        if part and (items == "-" or output in (None, "-")):
            raise OutputError("sharded and multi-process runs need an input file and an output file (-o)")
        task = load_spec(spec)
        if gold:
            task = dataclasses.replace(task, gold=gold)
        if (metrics or summary_md or junit or min_accuracy is not None) and not task.gold:
            raise SpecError("--metrics, --summary-md, --junit and --min-accuracy need a gold field ('gold' in the spec, or --gold)")
        in_fmt = detect_format(items, fmt)
        total = None
        if items != "-":  # validate the whole input before the model loads
            check = task.check_record if on_error == "fail" else (lambda record: None)
            total = scan_items(items, in_fmt, task.id_field, check)
            total = min(total, limit) if limit else total
        check_output(output, resume, overwrite)
        final = output
        if launched:
            output = part_path(final, *part)
            check_output(output, resume, overwrite)
        clf = Classifier.from_spec(task)
        for warning in lint_labels(clf.builder) if task.labels else ():
            logging.getLogger("prefixcache").warning("%s", warning)
        if launched and device == "auto":
            device = str(launched.device)  # accelerate's placement: cuda:<local rank>, or cpu
        dev = pick_device(device)
        fingerprint = {
            "spec": file_digest(str(spec)), "gold": task.gold, "model": model_identity(clf.source),
            "input": file_digest(items), "device": dev.split(":")[0], "dtype": str(pick_dtype(dtype, dev)).removeprefix("torch."),
        }
        clf.load_model(dev, dtype, None if no_cache_store else _store(cache_dir))
        start, stop = 0, total
        if part:  # whole batches per shard, so every shard forms the batches one process would
            starts = clf.batch_starts(islice(read_items(items, in_fmt, task.id_field), total), batch_size, batch_tokens, on_error)
            first, last = shard_range(len(starts), *part)
            start, stop = (starts + [total])[first], (starts + [total])[last]
            fingerprint.update(shard=f"{part[0] + 1}/{part[1]}", items=stop - start)
        done = start_output(output, resume, fingerprint)
        evaluation = evaluation_for(task, done.values())
        writer = open_writer(output, output_columns(task), append=bool(done))
        first_record = None
        try:
            with _progress(quiet) as progress, _signals() as stopped:
                left = None if total is None else max(stop - start - len(done), 0)
                bar = progress.add_task("classify", total=left, rate="")

                def advance(n: int) -> None:
                    progress.update(bar, advance=n, rate=f"{clf.stats.items_per_second:.1f} items/s")
                    if stopped:
                        raise _interrupted(stopped[0], clf.stats.items, output, spec, items)

                stream = islice(read_items(items, in_fmt, task.id_field), start, stop)
                for record in clf.classify(stream, batch_size, advance, batch_tokens, on_error, done):
                    writer.write(flatten_for_csv(record) if writer.fmt == "csv" else record)
                    first_record = first_record or time.perf_counter() - started
                    if evaluation and "error" not in record:
                        evaluation.add(record["gold"], record["label"])
        finally:
            writer.close()
        if not quiet:
            print_summary(err, clf.stats, first_record, len(done), f"shard {part[0] + 1}/{part[1]}: " if part else "")
        if launched:
            merged = merge_launched(launched, final)
            if merged is None:  # not rank 0: rank 0 reports on the whole
                evaluation = None
            else:
                if not quiet:
                    err.print(f"merged {merged} records from {launched.num_processes} processes into {final}")
                evaluation = evaluation_for(task, read_done(final).records)
        if evaluation:
            _report_evaluation(evaluation, quiet, metrics, summary_md, junit, min_accuracy)
        if clf.stats.errors:
            raise typer.Exit(EXIT_ITEM)


@contextmanager
def _signals() -> Iterator[list[int]]:
    """SIGINT/SIGTERM during scoring: note it (the run stops after the current batch); a second
    one stops at once."""
    import signal

    stopped: list[int] = []

    def handler(signum, frame):
        if stopped:
            raise KeyboardInterrupt
        stopped.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupted(signum: int, written: int, output: Optional[str], spec: Path, items: str) -> Interrupted:
    import signal

    name = signal.Signals(signum).name
    where = f" to {output}" if output and output != "-" else ""
    again = f"; resume with: prefixcache run {spec} {items} -o {output} --resume" if where else ""
    return Interrupted(signum, f"interrupted by {name}: {written} records written{where}{again}")


def _report_evaluation(evaluation, quiet: bool, metrics, summary_md, junit, min_accuracy) -> None:
    """Tables on stderr, the requested report files, and the accuracy gate."""
    from .report import print_evaluation, write_reports

    if not quiet:
        print_evaluation(err, evaluation)
    write_reports(evaluation, metrics, summary_md, junit, min_accuracy)
    if min_accuracy is not None and evaluation.accuracy < min_accuracy:
        err.print(f"gate failed: accuracy {evaluation.accuracy:.4f} is below --min-accuracy {min_accuracy}", markup=False)
        raise typer.Exit(EXIT_GATE)


@app.command()
def render(
    spec: Path = SPEC_ARG,
    items: str = ITEMS_ARG,
    fmt: Optional[str] = FORMAT_OPT,
    limit: Optional[int] = LIMIT_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Print, per item, exactly the tokens the scorer uses (one JSON object a line).

    `prompt_ids[:prefix_len]` is the cached prefix; a label's score is the summed log-prob of its
    `candidates` ids after `prompt_ids`. Loads the tokenizer only.

    Example:

        prefixcache render configs/support-tickets.yaml data/samples/tickets.jsonl --limit 1
    """
    from .run import Classifier
    from .spec import load_spec

    with _errors(debug):
        task = load_spec(spec)
        in_fmt = detect_format(items, fmt)
        clf = Classifier.from_spec(task)
        for item in islice(read_items(items, in_fmt, task.id_field), limit):
            sys.stdout.write(json.dumps(clf.render(item), ensure_ascii=False) + "\n")
        sys.stdout.flush()


@app.command()
def bench(
    spec: Path = SPEC_ARG,
    items: str = ITEMS_ARG,
    fmt: Optional[str] = FORMAT_OPT,
    limit: int = typer.Option(16, "--limit", "-n", min=1, help="Items for the naive modes (they are slow)."),
    max_items: Optional[int] = typer.Option(None, "--max-items", min=1, help="Items for the cached modes (default: all)."),
    batch_size: int = typer.Option(64, "--batch-size", "-b", min=1, help="Run pipeline: at most this many items per forward pass."),
    batch_tokens: int = typer.Option(768, "--batch-tokens", min=1, help="Run pipeline: about this many tokens per forward pass."),
    device: str = typer.Option("auto", "--device", envvar="PREFIXCACHE_DEVICE", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", "--dtype", envvar="PREFIXCACHE_DTYPE", help="auto, float32, bfloat16, float16."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of a table."),
    debug: bool = DEBUG_OPT,
) -> None:
    """Time the naive baselines, cached one-at-a-time scoring and the run pipeline on the same items.

    One process, one model load; each mode is timed after a warm-up. Reports ms/item, items/s,
    speed-up over the naive re-encode, the fraction of this machine's matmul peak reached on the
    unavoidable work, peak memory, and whether every mode chose the same labels.

    Example:

        prefixcache bench configs/support-tickets.yaml data/samples/tickets.jsonl --limit 8
    """
    from .bench import run_bench
    from .report import print_bench
    from .run import Classifier
    from .spec import load_spec

    _setup_logging(as_json)
    with _errors(debug):
        task = load_spec(spec)
        in_fmt = detect_format(items, fmt)
        records = list(islice(read_items(items, in_fmt, task.id_field), max_items))
        if not records:
            raise OutputError(f"{items}: no items to benchmark")
        clf = Classifier.from_spec(task)
        clf.load_model(device, dtype)
        report = run_bench(clf, records, min(limit, len(records)), batch_size, batch_tokens)
        if as_json:
            print(json.dumps(report.to_json(), indent=2))
        else:
            print_bench(report)


@app.command()
def merge(
    parts: list[str] = typer.Argument(..., help="The part files written with --shard K/N (any order).", show_default=False),
    output: str = typer.Option(..., "--output", "-o", help="The joined .jsonl or .csv."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    debug: bool = DEBUG_OPT,
) -> None:
    """Join the outputs of `run --shard K/N` into one file in input order.

    Checks that every shard 1..N is there exactly once, complete, from the same spec, model and
    input, and that no item appears twice.

    Example:

        prefixcache merge out.1.jsonl out.2.jsonl out.3.jsonl -o out.jsonl
    """
    from .shard import merge_parts

    with _errors(debug):
        check_output(output, False, overwrite)
        count = merge_parts(parts, output)
        err.print(f"merged {count} records from {len(parts)} parts into {output}", markup=False)


cache_app = typer.Typer(help="Inspect or clear the prefix store and converted models.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
def cache_list(cache_dir: Optional[Path] = CACHE_DIR_OPT, as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table.")) -> None:
    """List the stored prefixes (fingerprint, model, prefix tokens, size, last used) and converted models.

    Example:

        prefixcache cache list
    """
    from rich.table import Table

    from .load import cache_root
    from .store import describe

    store = _store(cache_dir)
    rows = [describe(e) for e in sorted(store.entries(), key=lambda e: -e.last_used)]
    models = sorted((cache_root() / "models").glob("*/prefixcache.json")) if (cache_root() / "models").is_dir() else []
    if as_json:
        for row in rows:
            print(json.dumps({"kind": "prefix", **row}))
        for m in models:
            print(json.dumps({"kind": "model", "path": str(m.parent), **json.loads(m.read_text())}))
        return
    table = Table("fingerprint", "model", "prefix tokens", "size MB", "last used", title=f"prefix store: {store.root}")
    for row in rows:
        table.add_row(row["fingerprint"], row["model"], str(row["prefix_tokens"]), f"{row['size_mb']:.1f}", row["last_used"])
    out = Console(highlight=False)
    out.print(table)
    for m in models:
        out.print(f"converted model: {m.parent} (from {json.loads(m.read_text()).get('source')})", soft_wrap=True)


@cache_app.command("clear")
def cache_clear(
    cache_dir: Optional[Path] = CACHE_DIR_OPT,
    models: bool = typer.Option(False, "--models", help="Also delete converted (dequantised GGUF) models."),
) -> None:
    """Delete every stored prefix (and with --models the converted models).

    Example:

        prefixcache cache clear --models
    """
    import shutil

    from .load import cache_root

    removed = _store(cache_dir).clear()
    err.print(f"removed {removed} stored prefixes", markup=False)
    if models and (cache_root() / "models").is_dir():
        shutil.rmtree(cache_root() / "models")
        err.print("removed the converted models", markup=False)


def main() -> None:
    try:
        app(prog_name="prefixcache")
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0) and not isinstance(code, int):
            code = EXIT_USAGE
        raise SystemExit(code)
