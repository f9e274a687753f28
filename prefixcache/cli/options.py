"""The command line's options and arguments: flags, short forms, environment fallbacks, help.
Shared by the commands in cli.py, so one option reads the same everywhere."""

from __future__ import annotations

import math
import os
from typing import Literal, Optional

import typer

from .. import __version__
from ..errors import EXIT_GATE, UsageError

# Values an option may take: shown in --help, checked before the command runs.
Format = Literal["jsonl", "csv", "tsv", "json", "parquet"]
OutFormat = Literal["jsonl", "csv"]
OnError = Literal["fail", "skip"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["debug", "info", "warning", "error"]

def _show_version(value: bool) -> None:
    if value:
        print(f"prefixcache {__version__}")
        raise typer.Exit()


VERSION_OPT = typer.Option(False, "--version", callback=_show_version, is_eager=True, metavar="", help="Show the version and exit.")
SPEC_ARG = typer.Argument(..., metavar="SPEC", help="Task spec (YAML).", show_default=False)
ITEMS_ARG = typer.Argument(..., metavar="ITEMS", help="Items: a .jsonl, .csv, .tsv, .json (an array) or .parquet file, the text ones optionally .gz; or - for stdin (with --format).", show_default=False)
FORMAT_OPT = typer.Option(None, "--format", "--input-format", "-f", help="Input format when it cannot be told from the extension.")
LIMIT_OPT = typer.Option(None, "--limit", "-n", min=1, help="Process only the first N items.")
DEBUG_OPT = typer.Option(False, "--debug", metavar="", help="Show a traceback for errors.")
CACHE_DIR_OPT = typer.Option(None, "--cache-dir", envvar="PREFIXCACHE_CACHE_DIR", show_envvar=False,
                             help="Where converted models and prefilled prefixes are kept (env PREFIXCACHE_CACHE_DIR; default ~/.cache/prefixcache).")
DEVICE_OPT = typer.Option("auto", "--device", envvar="PREFIXCACHE_DEVICE", metavar="auto|cpu|cuda|cuda:N|mps", help="Where the model runs (auto: CUDA when present, else the CPU).")
DELIMITER_OPT = typer.Option(None, "--delimiter", help="CSV/TSV field separator (default , for CSV, tab for TSV).")
ENCODING_OPT = typer.Option(None, "--encoding", help="CSV/TSV text encoding, e.g. latin-1 (default UTF-8).")
OUTPUT_FORMAT_OPT = typer.Option(None, "--output-format", "-F", help="Output format when the output's extension does not tell (stdout: jsonl unless csv).")
KEEP_OPT = typer.Option(None, "--keep", "-k", metavar="FIELD,...", help="Copy these input fields into each record (after the id; CSV: one column each).")
KEEP_ALL_OPT = typer.Option(False, "--keep-all", metavar="", help="Copy every input field into each record.")
OUTPUT_OPT = typer.Option(None, "--output", "-o", help="Output .jsonl or .csv; stdout (JSONL) when omitted.")
RESUME_OPT = typer.Option(False, "--resume", metavar="", help="Continue the output of an interrupted run, or of an input that has grown since: keep its records, score the rest.")
UPDATE_OPT = typer.Option(False, "--update", metavar="", help="Bring the output up to date with the input, whatever changed: keep the records of items whose id and fields are unchanged, score new and changed items, drop items no longer there.")
OVERWRITE_OPT = typer.Option(False, "--overwrite", metavar="", help="Replace an existing output file.")
ON_ERROR_OPT = typer.Option("fail", "--on-error", help="An item that cannot be scored: fail (stop after writing what is done) or skip (write an error record, go on).")
BATCH_SIZE_OPT = typer.Option(64, "--batch-size", "-b", min=1, envvar="PREFIXCACHE_BATCH_SIZE", help="At most this many items per forward pass.")
BATCH_TOKENS_OPT = typer.Option(768, "--batch-tokens", min=1, envvar="PREFIXCACHE_BATCH_TOKENS", help="About this many tokens per forward pass (items' own tokens + label tokens).")
MODEL_OPT = typer.Option(None, "--model", "-m", envvar="PREFIXCACHE_MODEL", help="The model, instead of the spec's: a hub id, a local model folder or a .gguf file.")
REVISION_OPT = typer.Option(None, "--revision", help="A hub model's branch, tag or commit (instead of the spec's 'revision').")
GOLD_OPT = typer.Option(None, "--gold", help="Item field with the expected label or option (overrides the spec's 'gold').")
METRICS_OPT = typer.Option(None, "--metrics", help="Write the evaluation as JSON to this file.")
SUMMARY_MD_OPT = typer.Option(None, "--summary-md", help="Write the evaluation as Markdown (e.g. $GITHUB_STEP_SUMMARY).")
JUNIT_OPT = typer.Option(None, "--junit", help="Write the evaluation as a JUnit XML report.")
MIN_ACCURACY_OPT = typer.Option(None, "--min-accuracy", min=0.0, max=1.0, help=f"Exit with code {EXIT_GATE} when accuracy is below this.")
MIN_RECALL_OPT = typer.Option(None, "--min-recall", min=0.0, max=1.0, help=f"Exit with code {EXIT_GATE} when any label's recall is below this.")
DTYPE_OPT = typer.Option("auto", "--dtype", envvar="PREFIXCACHE_DTYPE", help="auto: float32 on the CPU, bfloat16 (or float16) on CUDA.")
EXACT_OPT = typer.Option(False, "--exact", metavar="", help="With --dtype bfloat16: score in bfloat16, then score again in float32 the items whose decision rounding could change (float32 answers at about bfloat16 speed; both models in memory).")
NO_STORE_OPT = typer.Option(False, "--no-cache-store", metavar="", help="Neither load nor keep the prefilled prefix on disk.")
SHARD_OPT = typer.Option(None, "--shard", help="Run only shard K of N (K/N, 1-based), e.g. one CI matrix job; join the parts with `prefixcache merge`.")
QUIET_OPT = typer.Option(False, "--quiet", "-q", metavar="", help="No progress bar, summary, warnings or evaluation tables.")
DRY_RUN_OPT = typer.Option(False, "--dry-run", metavar="", help="Check the spec and the input, print each item's token counts (stdout) and the total with an estimated time (stderr); write nothing.")
LOG_INTERVAL_OPT = typer.Option(30.0, "--log-interval", min=1.0, envvar="PREFIXCACHE_LOG_INTERVAL", help="When stderr is not a terminal (cron, CI): seconds between progress lines.")
LOG_LEVEL_OPT = typer.Option("info", "--log-level", envvar="PREFIXCACHE_LOG_LEVEL", help="How much to log on stderr.")


BENCH_LIMIT_OPT = typer.Option(16, "--limit", "-n", min=1, help="Items for the naive modes (they are slow).")
MAX_ITEMS_OPT = typer.Option(None, "--max-items", min=1, help="Items for the cached modes (default: all).")
BENCH_BATCH_SIZE_OPT = typer.Option(64, "--batch-size", "-b", min=1, help="Run pipeline: at most this many items per forward pass.")
BENCH_BATCH_TOKENS_OPT = typer.Option(768, "--batch-tokens", min=1, help="Run pipeline: about this many tokens per forward pass.")
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
TOP_OPT = typer.Option(10, "--top", min=1, help="How many changed items and shifts to list.")
REPORT_OUTPUT_ARG = typer.Argument(..., metavar="OUT", help="An output of run (JSONL or CSV).", show_default=False)
REPORT_HTML_OPT = typer.Option("report.html", "--output", "-o", help="The HTML file to write.")
COMPARE_OPT = typer.Option(None, "--compare", help="Another output to compare with (see prefixcache diff).")
CLEAR_MODELS_OPT = typer.Option(False, "--models", metavar="", help="Also delete converted (dequantised GGUF) models.")


def field_list(text: Optional[str]) -> tuple[str, ...]:
    return tuple(name.strip() for name in (text or "").split(",") if name.strip())


def store_max_bytes() -> Optional[int]:
    """PREFIXCACHE_STORE_MAX_MB: the prefix store's bound (default 2048)."""
    limit = os.environ.get("PREFIXCACHE_STORE_MAX_MB")
    if not limit:
        return None
    try:
        megabytes = float(limit)
    except ValueError:
        megabytes = float("nan")
    if not math.isfinite(megabytes) or megabytes < 0:
        raise UsageError(f"PREFIXCACHE_STORE_MAX_MB must be a number of megabytes (0 or more), not {limit!r}")
    return int(megabytes * 2**20)
