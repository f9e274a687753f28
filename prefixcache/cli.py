"""The command line: parses options, turns library errors into one line and an exit code.

stdout carries data only (records, rendered prompts); progress, summaries and errors go to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import traceback
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from . import __version__, compat
from .errors import EXIT_GATE, EXIT_INTERNAL, EXIT_USAGE, Interrupted, OutputError, PrefixcacheError, SpecError
from .io import detect_format, read_items
from .job import Event, RunOptions, run_job
from .load import default_cache_dir, models_dir
from .output import check_output
from .report import print_bench, print_evaluation, print_summary
from .shard import merge_parts
from .spec import load_spec
from .task import Batching, Task

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


@contextmanager
def _progress(quiet: bool) -> Iterator[Callable[[Event], None]]:
    """What the CLI does as a run goes: once the input is checked, quiet the model libraries
    (their advice and progress bars would clutter stderr); while scoring, a Rich progress bar
    on stderr (a terminal only)."""
    bar = Progress(
        TextColumn("classifying"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(), console=err, disable=quiet or not err.is_terminal, transient=False,
    )
    task = None

    def on_event(event: Event) -> None:
        nonlocal task
        if event.phase == "checked":
            compat.quiet_libraries()
        elif event.phase == "scoring":
            bar.start()
            task = bar.add_task("classify", total=event.total, rate="")
        elif task is not None:
            bar.update(task, completed=event.written, rate=f"{event.rate:.1f} items/s")

    try:
        yield on_event
    finally:
        bar.stop()


SPEC_ARG = typer.Argument(..., help="Task spec (YAML).", show_default=False)
ITEMS_ARG = typer.Argument(..., help="Items: a .jsonl or .csv file, or - for stdin (with --format).", show_default=False)
FORMAT_OPT = typer.Option(None, "--format", "-f", help="Input format when it cannot be told from the extension: jsonl or csv.")
LIMIT_OPT = typer.Option(None, "--limit", "-n", min=1, help="Process only the first N items.")
DEBUG_OPT = typer.Option(False, "--debug", help="Show a traceback for errors.")
CACHE_DIR_OPT = typer.Option(None, "--cache-dir", envvar="PREFIXCACHE_CACHE_DIR", show_envvar=False,
                             help="Where converted models and prefilled prefixes are kept (env PREFIXCACHE_CACHE_DIR; default ~/.cache/prefixcache).")
DEVICE_OPT = typer.Option("auto", "--device", envvar="PREFIXCACHE_DEVICE", help="auto, cpu, cuda or mps.")
OUTPUT_OPT = typer.Option(None, "--output", "-o", help="Output .jsonl or .csv; stdout (JSONL) when omitted.")
RESUME_OPT = typer.Option(False, "--resume", help="Continue an interrupted run: keep its records, score the rest.")
OVERWRITE_OPT = typer.Option(False, "--overwrite", help="Replace an existing output file.")
ON_ERROR_OPT = typer.Option("fail", "--on-error", help="An item that cannot be scored: fail (stop after writing what is done) or skip (write an error record, go on).")
BATCH_SIZE_OPT = typer.Option(64, "--batch-size", "-b", min=1, envvar="PREFIXCACHE_BATCH_SIZE", help="At most this many items per forward pass.")
BATCH_TOKENS_OPT = typer.Option(768, "--batch-tokens", min=1, envvar="PREFIXCACHE_BATCH_TOKENS", help="About this many tokens per forward pass (items' own tokens + label tokens).")
GOLD_OPT = typer.Option(None, "--gold", help="Item field with the expected label or option (overrides the spec's 'gold').")
METRICS_OPT = typer.Option(None, "--metrics", help="Write the evaluation as JSON to this file.")
SUMMARY_MD_OPT = typer.Option(None, "--summary-md", help="Write the evaluation as Markdown (e.g. $GITHUB_STEP_SUMMARY).")
JUNIT_OPT = typer.Option(None, "--junit", help="Write the evaluation as a JUnit XML report.")
MIN_ACCURACY_OPT = typer.Option(None, "--min-accuracy", min=0.0, max=1.0, help=f"Exit with code {EXIT_GATE} when accuracy is below this.")
DTYPE_OPT = typer.Option("auto", "--dtype", envvar="PREFIXCACHE_DTYPE", help="auto (float32 on CPU, bf16/fp16 on CUDA), float32, bfloat16, float16.")
NO_STORE_OPT = typer.Option(False, "--no-cache-store", help="Neither load nor keep the prefilled prefix on disk.")
SHARD_OPT = typer.Option(None, "--shard", help="Run only shard K of N (K/N, 1-based), e.g. one CI matrix job; join the parts with `prefixcache merge`.")
QUIET_OPT = typer.Option(False, "--quiet", "-q", help="No progress bar, summary, warnings or evaluation tables.")
LOG_LEVEL_OPT = typer.Option("info", "--log-level", envvar="PREFIXCACHE_LOG_LEVEL", help="debug, info, warning or error (stderr).")


def _cache_dir(cache_dir: Optional[Path]) -> Path:
    return cache_dir.expanduser() if cache_dir else default_cache_dir()


def _store_max_bytes() -> Optional[int]:
    """PREFIXCACHE_STORE_MAX_MB: the prefix store's bound (default 2048)."""
    limit = os.environ.get("PREFIXCACHE_STORE_MAX_MB")
    try:
        return int(float(limit) * 2**20) if limit else None
    except ValueError:
        raise SpecError(f"PREFIXCACHE_STORE_MAX_MB must be a number of megabytes, not {limit!r}")


@app.command()
def run(
    spec: Path = SPEC_ARG, items: str = ITEMS_ARG, output: Optional[str] = OUTPUT_OPT, fmt: Optional[str] = FORMAT_OPT,
    resume: bool = RESUME_OPT, overwrite: bool = OVERWRITE_OPT, on_error: str = ON_ERROR_OPT,
    batch_size: int = BATCH_SIZE_OPT, batch_tokens: int = BATCH_TOKENS_OPT, limit: Optional[int] = LIMIT_OPT,
    gold: Optional[str] = GOLD_OPT, metrics: Optional[Path] = METRICS_OPT, summary_md: Optional[Path] = SUMMARY_MD_OPT,
    junit: Optional[Path] = JUNIT_OPT, min_accuracy: Optional[float] = MIN_ACCURACY_OPT, device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT, cache_dir: Optional[Path] = CACHE_DIR_OPT, no_cache_store: bool = NO_STORE_OPT,
    shard: Optional[str] = SHARD_OPT, quiet: bool = QUIET_OPT, log_level: str = LOG_LEVEL_OPT, debug: bool = DEBUG_OPT,
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
    _setup_logging(quiet, log_level)
    with _errors(debug):
        options = RunOptions(
            spec, items, output, fmt, resume, overwrite, on_error, batch_size, batch_tokens, limit, gold, metrics,
            summary_md, junit, min_accuracy, device, dtype, _cache_dir(cache_dir), not no_cache_store,
            _store_max_bytes(), shard,
        )
        with _progress(quiet) as bar, _signals() as stopped:
            result = run_job(options, progress=bar, stop=lambda: stopped[0] if stopped else None)
        if not quiet:
            print_summary(err, result)
            if result.merged is not None:
                err.print(f"merged {result.merged} records from {result.processes} processes into {result.output}")
            if result.evaluation:
                print_evaluation(err, result.evaluation)
        if result.gate_failed:
            err.print(f"gate failed: accuracy {result.evaluation.accuracy:.4f} is below --min-accuracy {min_accuracy}", markup=False)
        raise typer.Exit(result.exit_code)


@contextmanager
def _signals() -> Iterator[list[int]]:
    """SIGINT/SIGTERM during scoring: note it (the run stops after the current batch); a second
    one stops at once."""
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


@app.command()
def render(
    spec: Path = SPEC_ARG,
    items: str = ITEMS_ARG,
    fmt: Optional[str] = FORMAT_OPT,
    limit: Optional[int] = LIMIT_OPT,
    cache_dir: Optional[Path] = CACHE_DIR_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Print, per item, exactly the tokens the scorer uses (one JSON object a line).

    `prompt_ids[:prefix_len]` is the cached prefix; a label's score is the summed log-prob of its
    `candidates` ids after `prompt_ids`. Loads the tokenizer only.

    Example:

        prefixcache render configs/support-tickets.yaml data/samples/tickets.jsonl --limit 1
    """
    with _errors(debug):
        task_spec = load_spec(spec)
        in_fmt = detect_format(items, fmt)
        compat.quiet_libraries()
        task = Task.from_spec(task_spec, _cache_dir(cache_dir))
        for item in islice(read_items(items, in_fmt, task_spec.id_field), limit):
            sys.stdout.write(json.dumps(task.render(item), ensure_ascii=False) + "\n")
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
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    cache_dir: Optional[Path] = CACHE_DIR_OPT,
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
    from .bench import run_bench  # torch: only for this command
    from .scorer import Scorer

    _setup_logging(as_json)
    with _errors(debug):
        task_spec = load_spec(spec)
        in_fmt = detect_format(items, fmt)
        records = list(islice(read_items(items, in_fmt, task_spec.id_field), max_items))
        if not records:
            raise OutputError(f"{items}: no items to benchmark")
        compat.quiet_libraries()
        task = Task.from_spec(task_spec, _cache_dir(cache_dir))
        scorer = Scorer.load(task, _cache_dir(cache_dir), device, dtype)
        report = run_bench(scorer, records, min(limit, len(records)), Batching(batch_size, batch_tokens))
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
    from .store import PrefixStore, describe  # torch: only for this command

    root = _cache_dir(cache_dir)
    store = PrefixStore(root / "prefixes")
    rows = [describe(e) for e in sorted(store.entries(), key=lambda e: -e.last_used)]
    models = sorted(models_dir(root).glob("*/prefixcache.json")) if models_dir(root).is_dir() else []
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
    from .store import PrefixStore  # torch: only for this command

    root = _cache_dir(cache_dir)
    removed = PrefixStore(root / "prefixes").clear()
    err.print(f"removed {removed} stored prefixes", markup=False)
    if models and models_dir(root).is_dir():
        shutil.rmtree(models_dir(root))
        err.print("removed the converted models", markup=False)


def main() -> None:
    try:
        app(prog_name="prefixcache")
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0) and not isinstance(code, int):
            code = EXIT_USAGE
        raise SystemExit(code)
