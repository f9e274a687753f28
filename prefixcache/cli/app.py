"""The command line: parses options, turns library errors into one line and an exit code.

stdout carries data only (records, rendered prompts); progress, summaries and errors go to stderr.
"""

from __future__ import annotations

import json
import sys
from itertools import islice
from pathlib import Path
from typing import Any, Literal, Optional

import typer
from rich.console import Console

from .. import compat
from ..data.items import check_item, detect_format
from ..data.output import check_distinct, check_output, check_report
from ..errors import EXIT_GATE, EXIT_USAGE, UsageError
from ..reports.diff import compare_outputs, write_diff_reports
from ..reports.evaluation import write_report_file
from ..run.dryrun import dry_run as check_run
from ..run.job import RunResult, run_job
from ..run.options import RunOptions
from ..run.plan import load_options_spec, read_options_items
from ..run.shards import merge_parts
from ..scoring.prepare import Task
from ..serve.defaults import BATCH_WAIT_MS, MAX_BATCH
from .cache import cache_app
from .options import (
    BENCH_LIMIT_OPT, COMPARE_OPT, DEBUG_OPT, DEVICE, DIFF_A_ARG, DIFF_B_ARG, DIFF_JSON_OPT, DIFF_MD_OPT, DIFF_QUIET_OPT, DRY_RUN_OPT,
    EXAMPLES_OPT, REPORT_FIT_OPT, SERVE_HEAD_OPT, FIT_JSON_OPT, TARGET_ACCURACY_OPT, COVERAGE_OPT, CONFIDENCE_OPT, FIT_FEATURES_OPT, FitFeatures, PROMPT_SAMPLE_OPT, FITTED_OPT, FOLDS_OPT, OVERWRITE_FITTED_OPT, LABELLED_ARG, LABELLED_FILES_ARG, METRIC_OPT, MIN_COVERAGE_OPT, MODELS_OPT, OVERWRITE_TUNED_OPT, SEED_OPT, SYSTEM_OPT,
    POOL_ARG, SUGGEST_N_OPT, SUGGESTED_OPT, SUGGEST_LABELLED_OPT, SUGGEST_SEED_OPT, SUGGEST_RANDOM_OPT, SUGGEST_AUDIT_OPT,
    OVERWRITE_SUGGESTED_OPT, ALPHA_OPT, EARLIER_OPT, DRIFT_CUR_ARG, DRIFT_QUIET_OPT, DRIFT_REF_ARG, FAIL_ON_DRIFT_OPT,
    TEST_OPT, TUNED_OPT, TUNE_JSON_OPT, TUNE_MD_OPT, TUNE_TOP_OPT, VARIANTS_OPT,
    FAIL_ON_CHANGE_OPT, FAIL_ON_REGRESSION_OPT, INPUT, RENDER_TEXT_OPT, ITEMS_ARG, JSON_OPT, LOG_INTERVAL_OPT, LOG_LEVEL_OPT,
    MAX_ITEMS_OPT, MIN_ESTIMATED_OPT, MERGED_OPT, MODEL, PARTS_ARG, QUIET_OPT, REPORT_HTML_OPT, REPORT_OUTPUT_ARG, SPEC_ARG, TOP_OPT,
    VERSION_OPT, LogLevel, run_options, ALLOW_HOST_OPT, ALLOW_ORIGIN_OPT, DRAIN_SECONDS_OPT, MAX_REQUEST_TOKENS_OPT,
)
from .show import (rendered_text, print_bench, print_diff, print_drift, print_dry_run, print_evaluation, print_precision_bench,
                   print_fit, suggest_summary, print_summary, print_tune)
from .terminal import (Command, Commands, bench_step, err, say, errors, progress, reporting, setup_logging, signals,
                       steps, stopped_at_once)

app = typer.Typer(
    cls=Commands,
    context_settings={"help_option_names": ["-h", "--help"]},
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


@app.callback()
def _root(version: bool = VERSION_OPT) -> None:
    """Classify batches of text with a local language model, encoding the static prompt prefix once."""


@app.command(cls=Command)
@run_options("all")
def run(
    spec: Path = SPEC_ARG, items: str = ITEMS_ARG, quiet: bool = QUIET_OPT, log_level: LogLevel = LOG_LEVEL_OPT,
    log_interval: float = LOG_INTERVAL_OPT, dry_run: bool = DRY_RUN_OPT, debug: bool = DEBUG_OPT, **given: Any,
) -> None:
    """Classify every item and stream one record per item, in input order.

    An existing output is refused unless `--resume` (keep its records, score the rest: safe to
    repeat after any crash, and on an input that grew), `--update` (the input may have changed: keep
    the records of unchanged items, score new and changed ones) or `--overwrite`. Ctrl-C / SIGTERM
    finish the current batch, flush, and exit 130 / 143. With a gold field (spec key `gold` or
    `--gold`), the evaluation follows on stderr; `--min-accuracy` gates on it.

    Example:

        prefixcache run configs/support-tickets.yaml data/samples/tickets.jsonl -o predictions.jsonl

        prefixcache run spec.yaml export.jsonl -o out.jsonl --update --on-error skip   # cron

        cat items.csv | prefixcache run spec.yaml - --format csv > predictions.jsonl

        prefixcache run configs/irony.yaml data/samples/irony.jsonl -o out.jsonl --min-accuracy 0.6 --junit report.xml
    """
    setup_logging(quiet, log_level)
    with errors(debug):
        options = RunOptions(spec, items, **given)
        if dry_run:
            _dry_run(options, quiet, log_interval)
        with progress(quiet, log_interval) as reporter, signals(reporter) as stopped:
            result = run_job(options, progress=reporter, stop=lambda: stopped[0] if stopped else None)
        _show_result(result, quiet)
        raise typer.Exit(result.exit_code)


def _show_result(result: RunResult, quiet: bool) -> None:
    """The summary, the evaluation and the gates' verdicts, on stderr."""
    with reporting():
        if not quiet:
            print_summary(err, result, stamped=not err.is_terminal)
            if result.merged is not None:
                say(f"merged {result.merged} records from {result.processes} processes into {result.output}")
            if result.evaluation:
                print_evaluation(err, result.evaluation)
        for failure in result.gate_failures:
            say(f"gate failed: {failure}")


def _dry_run(options: RunOptions, quiet: bool, log_interval: float) -> None:
    with progress(quiet, log_interval) as reporter:
        planned = check_run(options, progress=reporter)
    print_dry_run(err, planned)
    raise typer.Exit(0)


@app.command(cls=Command)
@run_options(INPUT, MODEL, "limit")
def render(spec: Path = SPEC_ARG, items: str = ITEMS_ARG, text: bool = RENDER_TEXT_OPT, debug: bool = DEBUG_OPT,
           **given: Any) -> None:
    """Print, per item, exactly the tokens the scorer uses (one JSON object a line), or with
    `--text` the prompt as text, the cached prefix and the item's own part marked apart.

    `prompt_ids[:prefix_len]` is the cached prefix; a label's score is the summed log-prob of its
    `candidates` ids after `prompt_ids`. Loads the tokenizer only.

    Example:

        prefixcache render configs/support-tickets.yaml data/samples/tickets.jsonl --limit 1

        prefixcache render configs/support-tickets.yaml data/samples/tickets.jsonl --limit 1 --text
    """
    with errors(debug):
        options = RunOptions(spec, items, **given)
        task_spec = load_options_spec(options)
        compat.quiet_libraries()
        task = Task.from_spec(task_spec, options.cache_dir)
        source, fmt = "<stdin>" if items == "-" else items, detect_format(items, options.input_format)
        for item in islice(read_options_items(options, task_spec), options.limit):
            check_item(item, task_spec.check_record, source, fmt)  # as run's check: exit 2 naming the line
            for rendered in task.renders(item):
                sys.stdout.write(rendered_text(rendered, task.tokenizer.decode) if text
                                 else json.dumps(rendered, ensure_ascii=False) + "\n")
        sys.stdout.flush()


@app.command(cls=Command)
@run_options(INPUT, MODEL, DEVICE, "batch_size", "batch_tokens", "exact")
def bench(
    spec: Path = SPEC_ARG, items: str = ITEMS_ARG, limit: Optional[int] = BENCH_LIMIT_OPT,
    max_items: Optional[int] = MAX_ITEMS_OPT, as_json: bool = JSON_OPT, debug: bool = DEBUG_OPT, **given: Any,
) -> None:
    """Time the naive baselines, cached one-at-a-time scoring and the run pipeline on the same items.

    One process, one model load; each mode is timed after a warm-up. Reports ms/item, items/s,
    speed-up over the naive re-encode, the fraction of this machine's matmul peak reached on the
    unavoidable work, peak memory, and whether every mode chose the same labels.

    Example:

        prefixcache bench configs/support-tickets.yaml data/samples/tickets.jsonl --limit 8

        prefixcache bench configs/news-topics.yaml data/samples/headlines.jsonl --dtype bfloat16 --exact
    """
    from ..run.bench import PrecisionReport
    from ..run.benchjob import bench_job  # torch: only for this command

    setup_logging(as_json)
    with errors(debug):
        report = bench_job(RunOptions(spec, items, **given), limit, max_items, bench_step(), say)
        if as_json:
            print(json.dumps(report.to_json(), indent=2))
        elif isinstance(report, PrecisionReport):
            print_precision_bench(report)
        else:
            print_bench(report)


@app.command(cls=Command)
def diff(
    a: str = DIFF_A_ARG, b: str = DIFF_B_ARG, md: Optional[Path] = DIFF_MD_OPT, as_json: Optional[Path] = DIFF_JSON_OPT,
    fail_on_change: Optional[float] = FAIL_ON_CHANGE_OPT, fail_on_regression: bool = FAIL_ON_REGRESSION_OPT,
    top: int = TOP_OPT, quiet: bool = DIFF_QUIET_OPT, debug: bool = DEBUG_OPT,
) -> None:
    """Compare two runs joined by id: label changes, confidence shifts, and with gold values the
    accuracy of each, fixed and broken items and an exact McNemar test.

    Example:

        prefixcache diff before.jsonl after.jsonl --md "$GITHUB_STEP_SUMMARY" --fail-on-regression

        prefixcache diff before.jsonl after.jsonl -q --fail-on-change 0.05   # a CI gate, only its verdict
    """
    with errors(debug):
        cmp = compare_outputs(a, b)
        failures = cmp.gate_failures(fail_on_change, fail_on_regression)
        write_diff_reports(cmp, a, b, md, as_json, top)
        with reporting():
            if not quiet:
                print_diff(Console(highlight=False), cmp, a, b, top)
            for failure in failures:
                err.print(f"gate failed: {failure}", markup=False)
        raise typer.Exit(EXIT_GATE if failures else 0)


@app.command(cls=Command)
def drift(
    reference: str = DRIFT_REF_ARG, current: str = DRIFT_CUR_ARG, alpha: float = ALPHA_OPT,
    fail_on_drift: bool = FAIL_ON_DRIFT_OPT, min_estimated_accuracy: Optional[float] = MIN_ESTIMATED_OPT,
    md: Optional[Path] = DIFF_MD_OPT, as_json: Optional[Path] = DIFF_JSON_OPT, quiet: bool = DRIFT_QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Compare a run with a reference run on other items, without labels: whether its answers'
    shares, confidence and margins, and its abstained and failed items, are what the reference's
    were for samples of these sizes; its accuracy estimated from its answers' probabilities; and
    what changed in the model, spec, engine or precision.

    The verdict is one line on stderr (for a log); the tests' table on stdout.

    Example:

        prefixcache drift runs/reference.jsonl runs/tonight.jsonl --fail-on-drift   # a nightly gate

        prefixcache drift last-week.jsonl today.jsonl --md "$GITHUB_STEP_SUMMARY" --json drift.json
    """
    from ..reports.drift import compare_runs, write_drift_reports

    with errors(debug):
        found = compare_runs(reference, current, alpha)
        failures = found.gate_failures(fail_on_drift, min_estimated_accuracy)
        write_drift_reports(found, md, as_json)
        with reporting():
            if not quiet:
                print_drift(Console(highlight=False), found)
            err.print(found.line(), markup=False, soft_wrap=True)
            for failure in failures:
                err.print(f"gate failed: {failure}", markup=False)
        raise typer.Exit(EXIT_GATE if failures else 0)


@app.command(cls=Command)
@run_options("overwrite")
def report(
    output: str = REPORT_OUTPUT_ARG, html_file: str = REPORT_HTML_OPT, compare_with: Optional[str] = COMPARE_OPT,
    fit_figures: Optional[str] = REPORT_FIT_OPT, earlier: Optional[list[str]] = EARLIER_OPT, debug: bool = DEBUG_OPT,
    **given: Any,
) -> None:
    """Write one self-contained HTML page about an output: summary, evaluation, figures, confident
    mistakes and closest calls (and with --compare, the diff with another run; with --fit, the
    head's held-out figures and learning curve; with --earlier, the runs over time).

    Example:

        prefixcache report out.jsonl -o report.html --compare before.jsonl

        prefixcache report out.jsonl -o report.html --fit fitted.fit.json

        prefixcache report runs/today.jsonl -o runs.html --earlier runs/reference.jsonl --earlier runs/yesterday.jsonl
    """
    from ..reports.htmlpage import write_report  # matplotlib: an optional extra

    with errors(debug):
        write_report(output, html_file, compare_with, given["overwrite"], fit_figures, earlier or ())
        err.print(f"wrote {html_file}", markup=False)


@app.command(cls=Command)
@run_options("overwrite")
def merge(parts: list[str] = PARTS_ARG, output: str = MERGED_OPT, debug: bool = DEBUG_OPT, **given: Any) -> None:
    """Join the outputs of `run --shard K/N` into one file in input order.

    Checks that every shard 1..N is there exactly once, complete, from the same spec, model and
    input, and that no item appears twice.

    Example:

        prefixcache merge out.1.jsonl out.2.jsonl out.3.jsonl -o out.jsonl
    """
    with errors(debug):
        check_output(output, False, given["overwrite"], continuable=False)
        count = merge_parts(parts, output)
        err.print(f"merged {count} records from {len(parts)} parts into {output}", markup=False)


@app.command(cls=Command)
@run_options(INPUT, DEVICE, "batch_size", "batch_tokens", "revision", "cache_dir", "gold", "gold_sep", "limit")
def tune(
    spec: Path = SPEC_ARG, labelled: str = LABELLED_ARG, output: Optional[Path] = TUNED_OPT,
    test: Optional[str] = TEST_OPT, variants: Optional[Path] = VARIANTS_OPT, system: list[str] = SYSTEM_OPT,
    examples: list[Path] = EXAMPLES_OPT, model: list[str] = MODELS_OPT,
    metric: Literal["auto", "accuracy", "macro-f1"] = METRIC_OPT, min_coverage: Optional[float] = MIN_COVERAGE_OPT,
    folds: int = FOLDS_OPT, seed: int = SEED_OPT, as_json: bool = TUNE_JSON_OPT, md: Optional[Path] = TUNE_MD_OPT,
    top: int = TUNE_TOP_OPT, overwrite: bool = OVERWRITE_TUNED_OPT, quiet: bool = QUIET_OPT,
    log_interval: float = LOG_INTERVAL_OPT, debug: bool = DEBUG_OPT, **given: Any,
) -> None:
    """Choose the prompt and the decision rule on labelled items, and say how sure the choice is.

    Scores the items once per prompt variant (the spec's, `--variants`, every combination of
    `--system` and `--examples`, each with every `-m` model) and judges every decision rule on
    those scores: normalisations, calibration, thresholds. Each configuration's figures are
    held-out (k-fold cross-validation, or `--test`), with 95% bootstrap intervals; a winner is
    named only when it beats the spec as written beyond noise. `-o` writes the chosen spec.

    Example:

        prefixcache tune configs/irony.yaml data/samples/irony.jsonl --gold label -o tuned.yaml

        prefixcache tune spec.yaml dev.jsonl --test test.jsonl --system @terse.txt --examples more.yaml -m other-model
    """
    from ..tune import TuneOptions, plan_tune, tune as run_tune
    from ..tune.leaderboard import to_json, to_markdown

    setup_logging(quiet or as_json)
    with errors(debug):
        options = TuneOptions(RunOptions(spec, labelled, **given), test, variants, tuple(system), tuple(examples),
                              tuple(model), metric, min_coverage, folds, seed, output, overwrite)
        if md:
            check_report(md, "--md")
            check_distinct({"--md": md, "-o": output}, {"the spec": spec, "LABELLED": labelled, "--test": test})
        plan = plan_tune(options)
        with steps(quiet or as_json, log_interval) as step:
            compat.quiet_libraries()
            result = run_tune(options, step, plan)
        if md:
            write_report_file(md, to_markdown(result, top), append=True)
        if as_json:
            print(json.dumps(to_json(result), indent=2))
        else:
            print_tune(result, top)
        if result.written and not quiet:
            say(f"wrote {result.written}" + ("" if result.chosen_keys else " (the spec as written: no winner)"))


@app.command(cls=Command)
@run_options(INPUT, MODEL, DEVICE, "batch_size", "batch_tokens", "gold", "gold_sep", "limit")
def fit(
    spec: Path = SPEC_ARG, labelled: list[str] = LABELLED_FILES_ARG, output: Path = FITTED_OPT, folds: int = FOLDS_OPT,
    seed: int = SEED_OPT, figures: Optional[Path] = FIT_JSON_OPT, overwrite: bool = OVERWRITE_FITTED_OPT,
    target_accuracy: Optional[float] = TARGET_ACCURACY_OPT, coverage: Optional[float] = COVERAGE_OPT,
    confidence: Optional[float] = CONFIDENCE_OPT, features: FitFeatures = FIT_FEATURES_OPT,
    prompt_sample: Optional[int] = PROMPT_SAMPLE_OPT, quiet: bool = QUIET_OPT, log_interval: float = LOG_INTERVAL_OPT, debug: bool = DEBUG_OPT, **given: Any,
) -> None:
    """Train a head on your labelled items: a readout of the model's hidden state that answers
    in place of the prompt's label scores.

    Scores the labelled items once (the cached prefix, `run`'s batches), reads the model's final
    hidden state where each answer is scored (the same forward), and fits a logistic regression per
    question. Its accuracy, macro-F1 and calibration are measured held out (k-fold
    cross-validation) beside the prompt alone on the same folds, with 95% bootstrap intervals.
    Writes the fitted spec (`run`, `bench`, the Python API and Ray use it as any spec), the head
    file beside it, and the figures as JSON.

    Example:

        prefixcache fit configs/support-tickets.yaml labelled.jsonl --gold category -o fitted.yaml

        prefixcache run fitted.yaml new.jsonl -o predictions.jsonl

        prefixcache fit configs/support-emails.yaml labelled.jsonl -o fitted.yaml --target-accuracy 0.95
    """
    from ..labelled.fit import FitOptions, fit as run_fit, plan_fit

    setup_logging(quiet)
    with errors(debug):
        asked = _asked_cut(target_accuracy, coverage, confidence)
        options = FitOptions(RunOptions(spec, labelled[0], **given), output, folds, seed, figures, overwrite, asked,
                             features, prompt_sample, tuple(labelled[1:]))
        plan = plan_fit(options)
        with steps(quiet, log_interval) as step, stopped_at_once(FIT_KEPT):
            compat.quiet_libraries()
            result = run_fit(options, step, plan)
        if not quiet:  # -q: no tables (the figures are in the JSON file)
            print_fit(result)
            say("wrote " + ", ".join(str(p) for p in result.written))


FIT_KEPT = ("nothing written; the states and scores read so far are kept in the cache, and fit again reads them back "
            "and forwards only the rest")


def _asked_cut(target_accuracy: Optional[float], coverage: Optional[float], confidence: Optional[float]) -> Any:
    """fit's cut-point options as an `Asked` (None: no cut asked), or a UsageError."""
    from ..labelled.cutpoint import CONFIDENCE
    from ..labelled.heads import Asked

    if target_accuracy is not None and coverage is not None:
        raise UsageError("give --target-accuracy or --coverage, not both")
    if target_accuracy is not None and target_accuracy >= 1:
        raise UsageError(f"--target-accuracy {target_accuracy:g} cannot be certified: no number of held-out items "
                         f"proves an accuracy of 1 (the bound of n right out of n stays below it); ask for 0.99 or "
                         f"another value below 1")
    if confidence is not None and target_accuracy is None and coverage is None:
        raise UsageError("--confidence is the confidence of a cut: give --target-accuracy or --coverage with it")
    if not (target_accuracy or coverage):
        return None
    return Asked(target_accuracy, coverage, CONFIDENCE if confidence is None else confidence)


@app.command(cls=Command)
@run_options(INPUT, MODEL, DEVICE, "batch_size", "batch_tokens", "gold")
def suggest(
    spec: Path = SPEC_ARG, pool: str = POOL_ARG, count: int = SUGGEST_N_OPT, output: Path = SUGGESTED_OPT,
    labelled: list[str] = SUGGEST_LABELLED_OPT, seed: int = SUGGEST_SEED_OPT, random: bool = SUGGEST_RANDOM_OPT,
    audit: Optional[str] = SUGGEST_AUDIT_OPT, overwrite: bool = OVERWRITE_SUGGESTED_OPT, quiet: bool = QUIET_OPT, log_interval: float = LOG_INTERVAL_OPT,
    debug: bool = DEBUG_OPT, **given: Any,
) -> None:
    """Choose the items worth labelling next from a pool of unlabelled ones.

    With a fitted spec, the items its head is least sure of (smallest margin), spread over the
    model's hidden states so that they are not twenty copies of one kind; the gold column holds the
    head's guess, for you to correct. With a spec that has no head yet, a seed set that covers the
    kinds of item the pool holds. Items labelled already are never suggested: those the head was
    fitted on, those of --labelled files, and pool items whose gold is filled in (by id, and by text).
    Each row says how it was chosen (`picked_by`); with --random, a uniform sample of the pool
    (no model read): the rows fit estimates on, so that its figures describe the items it will answer.
    With --audit OUTPUT, a uniform sample of the items a run answered, to bound their accuracy.

    Example:

        prefixcache suggest fitted.yaml pool.csv -n 50 -o to_label.csv

        prefixcache suggest fitted.yaml month.jsonl --audit answers.jsonl -n 100 -o audit.csv

        prefixcache fit configs/support-tickets.yaml labelled.csv --gold category -o fitted.yaml --overwrite
    """
    from ..labelled.suggest import SuggestOptions, plan_suggest, suggest as run_suggest

    setup_logging(quiet)
    with errors(debug):
        options = SuggestOptions(RunOptions(spec, pool, **given), output, count, seed, tuple(labelled), overwrite,
                                 random, audit)
        plan = plan_suggest(options)
        with steps(quiet, log_interval) as step:
            compat.quiet_libraries()
            result = run_suggest(options, step, plan)
        if not quiet:
            say(suggest_summary(result))


def served_heads(paths: list[Path]) -> list[Any]:
    """The `--head` files, each read and checked before the model loads."""
    from ..task.head import load_head

    return [load_head(str(p), Path("--head")) for p in paths]


@app.command(cls=Command)
@run_options(MODEL, DEVICE)
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: this machine only)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on (0: any free port, said on stderr)."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help="Name of an environment variable holding "
                                              "the API key that requests must send as Authorization: Bearer KEY."),
    batch_wait_ms: float = typer.Option(BATCH_WAIT_MS, "--batch-wait-ms", min=0.0, help="Under load, how long a forward "
                                        "pass waits for more requests to join it (a lone request never waits)."),
    max_batch: int = typer.Option(MAX_BATCH, "--max-batch", min=1, help="At most this many requests in one forward pass."),
    max_request_tokens: int = MAX_REQUEST_TOKENS_OPT, drain_seconds: float = DRAIN_SECONDS_OPT,
    allow_host: list[str] = ALLOW_HOST_OPT, allow_origin: list[str] = ALLOW_ORIGIN_OPT,
    head: list[Path] = SERVE_HEAD_OPT,
    debug: bool = DEBUG_OPT,
    *, model: Optional[str], revision: Optional[str], device: str, dtype: str, cache_dir: Path,
    backend: Optional[str], threads: Optional[int],
) -> None:
    """Answer typed decisions over HTTP: TypeSafe's System One (`POST /v1/systemone`) and OpenAI's
    Decisions (`POST /v1/decisions`), with `GET /v1/models` and `GET /health`.

    A request `{instructions: S, state: T, questions: Q}` is answered as `run` answers an item whose
    state is T under the spec `{system: S, template: "{state}", questions: Q}`. Requests that
    arrive together share one forward pass; the instructions' prefix is kept between requests.
    Ctrl-C or SIGTERM stop taking requests, answer those queued for up to --drain-seconds (then
    503) and exit 0. Needs the `serve` extra: pip install 'prefixcache[serve]'.

    Example:

        prefixcache serve --port 8000

        curl -s localhost:8000/v1/systemone -H 'Content-Type: application/json' -d '{"model": "any", "state": "I was charged twice", "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"}}}'
    """
    from ..scoring.options import ScoringOptions
    from ..serve import api_key, serve as start  # the serve extra is imported (or refused) by `start`
    from ..serve.defaults import Limits

    with errors(debug):
        setup_logging(False)
        key = None if api_key_env is None else api_key(api_key_env, f"--api-key-env {api_key_env}")
        heads = served_heads(head)
        compat.quiet_libraries()
        limits = Limits(max_request_tokens, drain_seconds, tuple(allow_host), tuple(allow_origin))
        options = ScoringOptions.from_environment(cache_dir, device=device, dtype=dtype, backend=backend, threads=threads)
        start(model, options, host, port, key, batch_wait_ms,
              max_batch, heads=heads, revision=revision, limits=limits)


@app.command(cls=Command)
@run_options(MODEL, DEVICE)
def decide(
    requests: Path = typer.Argument(..., help="Request bodies, one JSON object a line (System One or OpenAI "
                                    "Decisions; an optional custom_id is echoed)."),
    output: Path = typer.Option(..., "--output", "-o", help="Where the responses go, one JSON line per request."),
    resume: bool = typer.Option(False, "--resume", help="Continue an output from its last complete line."),
    batch_size: int = typer.Option(MAX_BATCH, "--batch-size", "-b", min=1, help="Requests in one forward pass at most."),
    head: list[Path] = SERVE_HEAD_OPT,
    max_request_tokens: int = MAX_REQUEST_TOKENS_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
    *, model: Optional[str], revision: Optional[str], device: str, dtype: str, cache_dir: Path,
    backend: Optional[str], threads: Optional[int],
) -> None:
    """Answer logged decision requests offline, in order, with the engine of `serve`: one response
    line per request line, `{"custom_id", "line", "request_sha", "response": {"status_code",
    "body"}}`, the body what the server would answer.

    Lines sharing instructions share the cached prefix; responses are flushed after each pass
    (`--resume` continues). Exits 4 when a request was refused (its line holds the server's 4xx).

    Example:

        prefixcache decide requests.jsonl -o responses.jsonl
    """
    from ..errors import EXIT_ITEM
    from ..scoring.options import ScoringOptions
    from ..serve.decider import Decider  # no HTTP stack: decide needs no extra
    from ..serve.replay import replay

    with errors(debug):
        setup_logging(quiet)
        compat.quiet_libraries()
        heads = served_heads(head)
        options = ScoringOptions.from_environment(cache_dir, device=device, dtype=dtype, backend=backend, threads=threads)
        decider = Decider(model, options, heads=heads, revision=revision, max_tokens=max_request_tokens)
        shown = not quiet and err.is_terminal

        def step(done: int, total: int) -> None:
            if shown:
                err.print(f"\rdecide: {done}/{total} requests", end="")

        result = replay(decider, requests, output, resume, batch_size, step)
        if shown:
            err.print()
        if not quiet:
            kept = f", {result.resumed} kept from the earlier run" if result.resumed else ""
            say(f"decide: {result.answered + result.refused} responses to {output} ({result.answered} answered, "
                f"{result.refused} refused{kept}) in {result.seconds:.1f} s")
        if result.refused:
            raise typer.Exit(EXIT_ITEM)


app.add_typer(cache_app, name="cache")


def main() -> None:
    try:
        app(prog_name="prefixcache")
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0) and not isinstance(code, int):
            code = EXIT_USAGE
        raise SystemExit(code)
