"""The command line's options and arguments: flags, short forms, environment fallbacks, help.

The options of a run are not declared here: `run_options` turns the run's option table
(run/options.py) into command parameters, so `run`, `render`, `bench` and the `cache` commands
read the same `--format`, `--delimiter`, `--encoding`, `-m`, `--revision` and `--cache-dir` and
cannot drift. What is declared here belongs to one command's own interface."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Literal

import typer

from .. import __version__
from ..errors import EXIT_GATE
from ..run.options import Flag, RunOptions, flags
from ..serve.defaults import DRAIN_S, MAX_REQUEST_TOKENS

LogLevel = Literal["debug", "info", "warning", "error"]

def _show_version(value: bool) -> None:
    if value:
        print(f"prefixcache {__version__}")
        raise typer.Exit()


VERSION_OPT = typer.Option(False, "--version", callback=_show_version, is_eager=True, metavar="", help="Show the version and exit.")
SPEC_ARG = typer.Argument(..., metavar="SPEC", help="Task spec (YAML).", show_default=False)
ITEMS_ARG = typer.Argument(..., metavar="ITEMS", help="Items: a .jsonl, .csv, .tsv, .json (an array) or .parquet file, the text ones optionally .gz; or - for stdin (with --format).", show_default=False)
DEBUG_OPT = typer.Option(False, "--debug", metavar="", help="Show a traceback for errors.")
QUIET_OPT = typer.Option(False, "--quiet", "-q", metavar="", help="No progress bar, summary, warnings or evaluation tables.")
DRY_RUN_OPT = typer.Option(False, "--dry-run", metavar="", help="Check the spec and the input, print each item's token counts (stdout) and the total with an estimated time (stderr); write nothing.")
LOG_INTERVAL_OPT = typer.Option(30.0, "--log-interval", min=1.0, envvar="PREFIXCACHE_LOG_INTERVAL", help="When stderr is not a terminal (cron, CI): seconds between progress lines.")
LOG_LEVEL_OPT = typer.Option("info", "--log-level", envvar="PREFIXCACHE_LOG_LEVEL", help="How much to log on stderr.")


BENCH_LIMIT_OPT = typer.Option(None, "--limit", "-n", min=1, show_default=False,
                               help="Items for the naive modes, which are slow (default: 16, fewer with many labels).")
MAX_ITEMS_OPT = typer.Option(None, "--max-items", min=1, show_default=False,
                             help="Items for the cached modes (default: all up to 256, fewer with many labels).")
JSON_OPT = typer.Option(False, "--json", metavar="", help="Print the figures as JSON instead of a table.")
PARTS_ARG = typer.Argument(..., metavar="PART...", help="The part files written with --shard K/N (any order).", show_default=False)
MERGED_OPT = typer.Option(..., "--output", "-o", help="The joined .jsonl or .csv.")
JSON_LINES_OPT = typer.Option(False, "--json", metavar="", help="JSON lines instead of a table.")
DIFF_A_ARG = typer.Argument(..., metavar="A", help="An output of run (JSONL or CSV): before.", show_default=False)
DIFF_B_ARG = typer.Argument(..., metavar="B", help="An output of run: after.", show_default=False)
DIFF_MD_OPT = typer.Option(None, "--md", help="Append a Markdown version (a pull-request comment, $GITHUB_STEP_SUMMARY).")
DIFF_JSON_OPT = typer.Option(None, "--json", help="Write the figures as JSON to this file.")
FAIL_ON_CHANGE_OPT = typer.Option(None, "--fail-on-change", min=0.0, max=1.0, help=f"Exit {EXIT_GATE} when more than this share of the items changed label.")
FAIL_ON_REGRESSION_OPT = typer.Option(False, "--fail-on-regression", metavar="", help=f"Exit {EXIT_GATE} when accuracy dropped (needs gold values in both).")
DIFF_QUIET_OPT = typer.Option(False, "--quiet", "-q", metavar="", help="No listing on stdout: the report files and the gates' verdicts only.")
DRIFT_REF_ARG = typer.Argument(..., metavar="REFERENCE", help="An output of run (JSONL or CSV) whose answers are as they should be.", show_default=False)
DRIFT_CUR_ARG = typer.Argument(..., metavar="CURRENT", help="An output of run on other items, to compare with it.", show_default=False)
ALPHA_OPT = typer.Option(0.01, "--alpha", min=1e-9, max=0.5, help="The chance of a false alarm allowed in the whole comparison (shared among its tests).")
FAIL_ON_DRIFT_OPT = typer.Option(False, "--fail-on-drift", metavar="", help=f"Exit {EXIT_GATE} when the alarm fires (a cron job's or CI step's gate).")
MIN_ESTIMATED_OPT = typer.Option(None, "--min-estimated-accuracy", min=0.0, max=1.0, help=f"Exit {EXIT_GATE} when the current run's accuracy estimated from its answers' probabilities (a fitted head's are calibrated) is below this.")
DRIFT_QUIET_OPT = typer.Option(False, "--quiet", "-q", metavar="", help="No table on stdout: the verdict line (stderr) and the report files only.")
TOP_OPT = typer.Option(10, "--top", min=1, help="How many changed items and shifts to list (on the terminal, in --md and in --json).")
REPORT_OUTPUT_ARG = typer.Argument(..., metavar="OUT", help="An output of run (JSONL or CSV).", show_default=False)
REPORT_HTML_OPT = typer.Option("report.html", "--output", "-o", help="The HTML file to write.")
COMPARE_OPT = typer.Option(None, "--compare", help="Another output to compare with (see prefixcache diff).")
RENDER_TEXT_OPT = typer.Option(False, "--text", "-t", metavar="", help="The prompt as readable text, the cached prefix and the item's part marked apart, and the candidates.")
LABELLED_ARG = typer.Argument(..., metavar="LABELLED", help="Items with gold values: a .jsonl, .csv, .tsv, .json or .parquet file.", show_default=False)
TEST_OPT = typer.Option(None, "--test", help="Held-out items with gold values: choose on LABELLED, measure on these (instead of cross-validation).")
VARIANTS_OPT = typer.Option(None, "--variants", help="YAML list of prompt variants, each the spec keys it sets (system, examples, template, labels, model, ...).")
SYSTEM_OPT = typer.Option([], "--system", help="An alternative system prompt (@FILE: a file's text); repeat for more.", show_default=False)
EXAMPLES_OPT = typer.Option([], "--examples", help="An alternative example set: a YAML/JSON list or JSON lines; repeat for more.", show_default=False)
MODELS_OPT = typer.Option([], "--model", "-m", help="Another model to compare (hub id, folder or .gguf); repeat for more.", show_default=False)
METRIC_OPT = typer.Option("auto", "--metric", help="What the choice maximises (auto: macro-F1 for multi-label tasks, accuracy otherwise).")
MIN_COVERAGE_OPT = typer.Option(None, "--min-coverage", min=0.0, max=1.0, help="Fit an abstention threshold per rule: the best accuracy of the answered items that still answers this share.")
FOLDS_OPT = typer.Option(5, "--folds", min=2, help="Cross-validation folds.")
SEED_OPT = typer.Option(0, "--seed", help="Seed of the folds and the bootstrap.")
TUNED_OPT = typer.Option(None, "--output", "-o", help="Write the chosen spec here (the spec's comments kept).")
TUNE_JSON_OPT = typer.Option(False, "--json", metavar="", help="Print the findings as JSON instead of the table.")
TUNE_MD_OPT = typer.Option(None, "--md", help="Append a Markdown leaderboard (a CI step summary, $GITHUB_STEP_SUMMARY).")
OVERWRITE_TUNED_OPT = typer.Option(False, "--overwrite", metavar="", help="Replace the tuned spec (-o) if it exists.")
LABELLED_FILES_ARG = typer.Argument(..., metavar="LABELLED...", help="Items with gold values: .jsonl, .csv, .tsv, .json or .parquet files (several: read as one, an id at most once).", show_default=False)
FITTED_OPT = typer.Option(..., "--output", "-o", help="The fitted spec to write (the spec with 'head:' set); the head (NAME.head.safetensors) and the figures (NAME.fit.json) are written beside it.", show_default=False)
TARGET_ACCURACY_OPT = typer.Option(None, "--target-accuracy", min=0.0, max=1.0, help=(
    "Choose where the head abstains: the widest confidence cut whose answered items reach this accuracy with "
    "--confidence, on the held-out predictions (one-sided exact binomial bound, cuts tried most confident first); written "
    "into the fitted spec as the question's threshold, with the risk-coverage table printed. When no cut reaches "
    "it, fit says by how far and writes none."))
COVERAGE_OPT = typer.Option(None, "--coverage", min=0.0, max=1.0, help=(
    "Instead of --target-accuracy: the cut that answers this share of the items (the rest abstain), with the "
    "accuracy it gives held out."))
CONFIDENCE_OPT = typer.Option(None, "--confidence", min=0.5, max=0.9999, show_default=False,
                              help="The confidence of --target-accuracy or --coverage (default 0.95).")
FIT_FEATURES_OPT = typer.Option("state", "--features", help=(
    "What the heads read. state (the default): views of the model's forward alone, chosen by inner "
    "cross-validation among the final state where the answer is scored, that and the mean over the item's tokens, "
    "and a middle layer's state and mean (the fitted spec answers without scoring any option). auto: also the "
    "options' log-probabilities, chosen only where they help beyond noise (every option of every item is then "
    "scored, at fit and at run time). Or one feature set, e.g. state@15+mean@15."))
FitFeatures = str
PROMPT_SAMPLE_OPT = typer.Option(None, "--prompt-sample", min=1, help=(
    "How many labelled items (drawn at random) have their options scored to measure the prompt alone beside the "
    "head. Default: as many as cost about what reading the states costs, at least 20."), show_default=False)
POOL_ARG = typer.Argument(..., metavar="POOL", help="Unlabelled items to choose from: a .jsonl, .csv, .tsv, .json or .parquet file.", show_default=False)
SUGGEST_N_OPT = typer.Option(50, "-n", "--count", min=1, help="How many items to suggest.")
SUGGESTED_OPT = typer.Option(..., "--output", "-o", help="The items to label: .csv, else JSON lines (id, the template's fields, the gold column holding the head's guess to correct, its probability and margin).", show_default=False)
SUGGEST_LABELLED_OPT = typer.Option([], "--labelled", help="A file of items labelled already (never suggested, by id or text); repeat for more. The items the spec's head was fitted on are left out without it.", show_default=False)
SUGGEST_SEED_OPT = typer.Option(0, "--seed", help="Seed of the clustering (or of --random's draw).")
SUGGEST_RANDOM_OPT = typer.Option(False, "--random", help=(
    "Draw the rows at random from the pool (no model is read; picked_by: random): fit estimates its figures and "
    "certifies its cuts on such rows, so that they describe the items the head will answer, not the hardest ones."))
SUGGEST_AUDIT_OPT = typer.Option(None, "--audit", metavar="OUTPUT", help=(
    "Draw the rows at random from the items a run answered (OUTPUT: its records of POOL; no model is read; "
    "picked_by: audit): label them, then `run` the spec on the file with --min-answered-accuracy to bound the "
    "accuracy of what the head answers."), show_default=False)
OVERWRITE_SUGGESTED_OPT = typer.Option(False, "--overwrite", metavar="", help="Replace -o if it exists.")
FIT_JSON_OPT = typer.Option(None, "--json", help="Write the figures as JSON here instead of beside the fitted spec.")
OVERWRITE_FITTED_OPT = typer.Option(False, "--overwrite", metavar="", help="Replace the fitted spec, its head and figures if they exist.")
EARLIER_OPT = typer.Option(None, "--earlier", metavar="OUTPUT", help="An earlier run's output, oldest first, the first the reference (repeat it): the answers' shares, confidence, drift verdict, estimated accuracy and unfamiliar items over the runs.")
REPORT_FIT_OPT = typer.Option(None, "--fit", metavar="FIGURES", help="The figures prefixcache fit wrote (NAME.fit.json): add the head's held-out figures beside the prompt's and its learning curve.")
MAX_REQUEST_TOKENS_OPT = typer.Option(MAX_REQUEST_TOKENS, "--max-request-tokens", min=1, help=(
    "The most tokens one request may have computed (its instructions when new, its state, its questions and their "
    "options): more is answered 413, never computed. A light request waits at most for one pass of about this size."))
DRAIN_SECONDS_OPT = typer.Option(DRAIN_S, "--drain-seconds", min=0.0, help=(
    "After SIGTERM or Ctrl-C, how long requests already queued are still answered; those left then get 503 with "
    "Retry-After. A second signal exits at once."))
ALLOW_HOST_OPT = typer.Option([], "--allow-host", help=(
    "A Host name to accept besides this machine's (localhost, 127.0.0.1, ::1) when bound to it; repeat for more, * "
    "for any. Other names are refused (403), so that a web page cannot reach the server through a name it points at "
    "this machine (DNS rebinding)."))
ALLOW_ORIGIN_OPT = typer.Option([], "--allow-origin", help=(
    "A web page origin (scheme://host[:port]) whose requests are accepted; repeat for more, * for any. Requests a "
    "browser sends from other pages' origins are refused (403)."))
SERVE_HEAD_OPT = typer.Option([], "--head", metavar="FILE", help="A head written by prefixcache fit (NAME.head.safetensors): it answers the requests whose instructions and questions are those of the spec it was fitted on (system: the instructions, template: \"{state}\"), on this model; repeat for more.", show_default=False)
TUNE_TOP_OPT = typer.Option(12, "--top", min=1, help="Rows of the leaderboard shown (the spec as written and the pick always).")
CLEAR_MODELS_OPT = typer.Option(False, "--models", metavar="", help="Also delete converted (dequantised GGUF) models.")


# -- the run's options, from its table ----------------------------------------------------------
INPUT = "input"  # --format, --delimiter, --encoding: how the items are read
MODEL = "model"  # -m, --revision, --cache-dir: which model, where converted models are kept
DEVICE = "device"  # --device, --dtype, --backend, --threads


def _cli_default(f: dataclasses.Field, flag: Flag) -> Any:
    if flag.cli_type is bool:
        return False
    if flag.parse is not None or f.default is dataclasses.MISSING:
        return None
    return f.default


def _parameter(f: dataclasses.Field, flag: Flag) -> inspect.Parameter:
    option = typer.Option(
        _cli_default(f, flag), *flag.names, help=flag.help, envvar=flag.envvar, metavar=flag.metavar,
        min=flag.min, max=flag.max, show_envvar=flag.envvar is not None and "env " not in flag.help,
    )
    annotation = flag.cli_type if flag.cli_type is not None else typing.get_type_hints(RunOptions)[f.name]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def run_options(*chosen: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the run options of these groups (INPUT, MODEL, DEVICE) or names ("limit";
    "all" for every one), declared from the run's table. The command takes them as `**given` (or
    as keyword-only parameters of those names), already turned into `RunOptions` values:

        @app.command()
        @run_options(INPUT, MODEL, "limit")
        def render(spec: Path = SPEC_ARG, items: str = ITEMS_ARG, **given):
            options = RunOptions(spec, items, **given)
    """
    table = [(f, flag) for f, flag in flags() if "all" in chosen or flag.group in chosen or f.name in chosen]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        names = {f.name for f, _ in table}  # a command may name the ones it takes instead of `**given`
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(command).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name not in names]
        arguments = [p for p in own if isinstance(p.default, typer.models.ArgumentInfo)]
        added = [_parameter(f, flag) for f, flag in table]
        rest = [p for p in own if p not in arguments]

        @functools.wraps(command)
        def with_options(**values: Any) -> Any:
            given = {f.name: _value(flag, values.pop(f.name)) for f, flag in table}
            return command(**values, **given)

        with_options.__signature__ = inspect.Signature(arguments + added + rest)  # type: ignore[attr-defined]
        with_options.__annotations__ = {**command.__annotations__, **{p.name: p.annotation for p in added}}
        return with_options

    return decorate


def _value(flag: Flag, value: Any) -> Any:
    return flag.parse(value) if flag.parse is not None else value
