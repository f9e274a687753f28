"""Everything a run takes, in one table: `RunOptions`.

Each field of `RunOptions` is one option of `prefixcache run`, and its `Flag` says how it is
written on the command line. That one table drives the command line's declaration (cli/options.py
builds the `run`, `render` and `bench` parameters from it), the command line that resumes a run
(`command_line`), and the option a fingerprint refusal names (`option_words`). Adding a run option
is adding a field here and reading it where it is used. No torch, no typer here.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from ..errors import EXIT_GATE
from ..model.cache import cache_root, store_max_bytes
from ..model.choice import engines, engines_words
from ..scoring.options import BATCH_SIZE, BATCH_TOKENS, ScoringOptions
from ..task.spec import TaskSpec

# Values an option may take: shown in --help, checked before the command runs.
Format = Literal["jsonl", "csv", "tsv", "json", "parquet"]
OutFormat = Literal["jsonl", "csv"]
OnError = Literal["fail", "skip"]
Prune = Literal["auto", "on", "exact", "off"]
Dtype = Literal["auto", "float32", "bfloat16", "float16", "int8"]


def field_list(text: Optional[str]) -> tuple[str, ...]:
    """`a, b,c` -> ("a", "b", "c")."""
    return tuple(name.strip() for name in (text or "").split(",") if name.strip())


@dataclass(frozen=True)
class Flag:
    """How one run option is written on the command line.

    names: the option's names, long first ("--batch-size", "-b"); `group`: "input" (how the items
    are read), "model" (which model, where converted models live), "device" (where and in which
    precision it runs) or "" (the run itself): other commands that read items or load a model take
    those groups too. `cli_type` is what the command line
    parses when it differs from the field's type, `parse` turns it into the field's value, and
    `words` turns a value back into command-line words (for the resume command)."""

    names: tuple[str, ...]
    help: str
    group: str = ""
    envvar: Optional[str] = None
    metavar: Optional[str] = None
    min: Optional[float] = None
    max: Optional[float] = None
    cli_type: Any = None
    parse: Optional[Callable[[Any], Any]] = None
    words: Optional[Callable[[Any], list[str]]] = None
    spelled: Optional[str] = None  # how a command line this program prints names it (default: the first name)

    @property
    def name(self) -> str:
        return self.spelled or self.names[0]


def _opt(default: Any, *names: str, help: str, factory: Optional[Callable[[], Any]] = None, **flag: Any) -> Any:
    meta = {"flag": Flag(names, help, **flag)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _switch(name: str) -> Callable[[Any], list[str]]:
    return lambda value: [name] if value else []


@dataclass(frozen=True)
class RunOptions:
    """Everything a run takes: the `run` command's arguments and options."""

    spec: Path
    items: str  # a file, or "-" for stdin
    output: Optional[str] = _opt(None, "--output", "-o", spelled="-o", help="Output .jsonl or .csv; stdout (JSONL) when omitted.")
    input_format: Optional[str] = _opt(
        None, "--format", "--input-format", "-f", group="input", cli_type=Optional[Format],
        help="Input format when it cannot be told from the extension.")
    delimiter: Optional[str] = _opt(None, "--delimiter", group="input",
                                    help="CSV/TSV field separator (default , for CSV, tab for TSV).")
    encoding: Optional[str] = _opt(None, "--encoding", group="input",
                                   help="CSV/TSV text encoding, e.g. latin-1 (default UTF-8).")
    output_format: Optional[str] = _opt(
        None, "--output-format", "-F", cli_type=Optional[OutFormat],
        help="Output format when the output's extension does not tell (stdout: jsonl unless csv).")
    keep: tuple[str, ...] = _opt(
        (), "--keep", "-k", metavar="FIELD,...", cli_type=Optional[str], parse=field_list,
        words=lambda names: ["--keep", ",".join(names)] if names else [],
        help="Copy these input fields into each record (after the id; CSV: one column each).")
    keep_all: bool = _opt(False, "--keep-all", metavar="", words=_switch("--keep-all"),
                          help="Copy every input field into each record.")
    resume: bool = _opt(False, "--resume", metavar="", help=(
        "Continue the output of an interrupted run, or of an input that has grown since: keep its records, "
        "score the rest."))
    update: bool = _opt(False, "--update", metavar="", help=(
        "Bring the output up to date with the input, whatever changed: keep the records of items whose id and "
        "fields are unchanged, score new and changed items, drop items no longer there."))
    overwrite: bool = _opt(False, "--overwrite", metavar="", help="Replace an existing output file.")
    on_error: str = _opt("fail", "--on-error", cli_type=OnError, help=(
        "An item that cannot be scored: fail (stop after writing what is done) or skip (write an error record, "
        "go on)."))
    batch_size: int = _opt(BATCH_SIZE, "--batch-size", "-b", min=1, envvar="PREFIXCACHE_BATCH_SIZE",
                           help="At most this many items per forward pass.")
    batch_tokens: int = _opt(BATCH_TOKENS, "--batch-tokens", min=1, envvar="PREFIXCACHE_BATCH_TOKENS",
                             help="About this many tokens per forward pass (items' own tokens + label tokens).")
    limit: Optional[int] = _opt(None, "--limit", "-n", min=1, help="Process only the first N items.")
    model: Optional[str] = _opt(
        None, "--model", "-m", group="model", envvar="PREFIXCACHE_MODEL",
        help="The model (instead of the spec's, where there is one): a hub id, a local model folder or a .gguf "
             "file; default: the embedded model.")
    revision: Optional[str] = _opt(None, "--revision", group="model",
                                   help="A hub model's branch, tag or commit (instead of the spec's 'revision').")
    gold: Optional[str] = _opt(None, "--gold", help=(
        "Item field with the expected label or option (overrides the spec's 'gold'); typed questions: "
        "QUESTION=FIELD pairs separated by commas. --gold '' runs a spec that names one on unlabelled items."))
    gold_sep: Optional[str] = _opt(None, "--gold-sep", help=(
        "Multi-label: what separates the labels in a gold string (default ','; a JSON list is always read as one)."))
    metrics: Optional[Path] = _opt(None, "--metrics", help="Write the evaluation as JSON to this file.")
    prompt_scores: bool = _opt(False, "--prompt-scores", metavar="", words=_switch("--prompt-scores"), help=(
        "With a fitted head (the spec's 'head'): score every option too and keep their log-probabilities in the "
        "records. Without it, a head that reads the model's state alone answers alone: no option token goes "
        "through the model, whatever the number of labels."))
    review: Optional[Path] = _opt(None, "--review", metavar="FILE", help=(
        "Write the items the run abstained on (below a threshold: a fitted head's cut, or the spec's) to FILE, CSV or "
        "JSONL by its extension, for a person to label: id, the item's fields, the top guesses with their "
        "probabilities and an empty gold column. Rewritten whole when the output is complete (a resumed run lists "
        "each item once)."))
    summary_md: Optional[Path] = _opt(None, "--summary-md",
                                      help="Write the evaluation as Markdown (e.g. $GITHUB_STEP_SUMMARY).")
    junit: Optional[Path] = _opt(None, "--junit", help="Write the evaluation as a JUnit XML report.")
    min_accuracy: Optional[str] = _opt(None, "--min-accuracy", metavar="NUMBER|QUESTION=NUMBER,...", help=(
        f"Exit with code {EXIT_GATE} when accuracy is below this (typed questions: every question's, or name "
        f"them: team=0.8,blocked=0.9)."))
    min_recall: Optional[float] = _opt(None, "--min-recall", min=0.0, max=1.0,
                                       help=f"Exit with code {EXIT_GATE} when any label's recall is below this.")
    min_answered_accuracy: Optional[float] = _opt(None, "--min-answered-accuracy", min=0.0, max=1.0, help=(
        f"Exit with code {EXIT_GATE} when the accuracy of the items answered (not abstained) has an exact 95% lower "
        f"bound below this: an audit of a fitted head's cut on labelled items drawn at random (suggest --random)."))
    device: str = _opt("auto", "--device", group="device", envvar="PREFIXCACHE_DEVICE", metavar="auto|cpu|cuda|cuda:N|mps",
                       help="Where the model runs (auto: CUDA when present, else the CPU).")
    dtype: str = _opt("auto", "--dtype", group="device", envvar="PREFIXCACHE_DTYPE", cli_type=Dtype,
                      help=("auto: float32 on the CPU, bfloat16 (or float16) on CUDA; `run` on a CPU with bfloat16 "
                            "matrix instructions: bfloat16 with --exact for a model of 0.3B parameters or more. int8: "
                            "the linear layers' weights and activations in int8 on the int8 dot-product units (needs "
                            "the int8 extra)."))
    backend: Optional[str] = _opt(None, "--backend", group="device", envvar="PREFIXCACHE_BACKEND", cli_type=Optional[str],
                                  metavar=f"<{'|'.join(engines())}>",
                                  help=(
        f"What runs the model: {engines_words()}. Default: the spec's 'backend', else auto."))
    threads: Optional[int] = _opt(None, "--threads", group="device", envvar="PREFIXCACHE_THREADS", min=1,
                                  help="CPU threads the model computes with (default: every core).")
    exact: bool = _opt(False, "--exact", metavar="", words=_switch("--exact"), help=(
        "With --dtype bfloat16 (or int8): score in it, then score again in float32 the items whose decision rounding "
        "could change: float32's labels (typed questions: every question's decision). Which items follows from the "
        "scores alone, by a bound measured once on the input's first items and kept; the float32 weights load only "
        "when needed. Its speed depends on how many items are close calls (docs/models.md); `bench --exact` "
        "measures yours."))
    prune: str = _opt("auto", "--prune", cli_type=Prune, help=(
        "Labels, and typed questions' choice questions: score the candidates best-first and stop scoring those "
        "that can no longer win. on: the same answers (and abstentions), the other probabilities computed with "
        "the candidates left at a bound (the winner's a lower bound); exact: also every probability within 1e-4, "
        "which pays only where the model is sure of its answers. Records list the candidates left at a bound. "
        "auto (the default): every candidate is scored. bench times each on your spec."))
    cache_dir: Path = _opt(
        None, "--cache-dir", group="model", factory=cache_root, envvar="PREFIXCACHE_CACHE_DIR",
        cli_type=Optional[Path], parse=lambda path: path.expanduser() if path else cache_root(),
        help="Where converted models and prefilled prefixes are kept (env PREFIXCACHE_CACHE_DIR; default "
             "~/.cache/prefixcache).")
    cache_store: bool = _opt(True, "--no-cache-store", metavar="", cli_type=bool, parse=lambda no: not no,
                             words=lambda store: [] if store else ["--no-cache-store"],
                             help="Neither load nor keep the prefilled prefix on disk.")
    store_max_bytes: Optional[int] = field(default_factory=store_max_bytes)  # env PREFIXCACHE_STORE_MAX_MB (None: default)
    shard: Optional[str] = _opt(None, "--shard", help=(
        "Run only shard K of N (K/N, 1-based), e.g. one CI matrix job; join the parts with `prefixcache merge`."))

    def scoring(self, **changes: object) -> ScoringOptions:
        """The scoring slice of these options, shared with `Classifier` and `tune` (`changes` set
        over it)."""
        mine = ScoringOptions(self.cache_dir, self.device, self.dtype, self.exact, self.prune, self.cache_store,
                              self.store_max_bytes, self.backend, self.threads, self.prompt_scores)
        return mine.replace(**changes)


def flags(group: Optional[str] = None) -> list[tuple[dataclasses.Field, Flag]]:
    """The run options written on the command line (those of one `group` when given), in table order."""
    found = [(f, f.metadata["flag"]) for f in dataclasses.fields(RunOptions) if "flag" in f.metadata]
    return [(f, flag) for f, flag in found if group is None or flag.group == group]


def _words(name: str, value: Any) -> list[str]:
    flag = dict((f.name, fl) for f, fl in flags())[name]
    if flag.words:
        return flag.words(value)
    if value is True:
        return [flag.name]
    return [] if value in (None, False) else [flag.name, str(value)]


def option_words(name: str, value: Any) -> Optional[str]:
    """How the command line says that a run option has `value` ("--keep id,text", "--batch-size 8",
    "no --exact"); None when `name` is no option of the table."""
    if name not in {f.name for f, _ in flags()}:
        return None
    words = _words(name, value)
    return shlex.join(words) if words else f"no {dict((f.name, fl) for f, fl in flags())[name].name}"


def command_line(options: RunOptions) -> str:
    """The `prefixcache run` command that continues this run: its arguments and every option that
    is not at its default (whether it came from the command line or the environment)."""
    default = RunOptions(options.spec, options.items)
    words = ["prefixcache", "run", str(options.spec), options.items]
    for f, _ in flags():
        if f.name in ("resume", "update", "overwrite"):
            continue
        value = getattr(options, f.name)
        if value != getattr(default, f.name):
            words += _words(f.name, value)
    words.append("--update" if options.update else "--resume")
    return shlex.join(words)


BENCH_NAIVE_ITEMS, BENCH_ITEMS = 16, 256  # bench's sizes for a task of up to 8 labels


def bench_sizes(spec: TaskSpec, naive: Optional[int] = None, cached: Optional[int] = None) -> tuple[int, int]:
    """How many items `bench` times in its naive modes and in the others, where not given: the
    naive modes run a full forward per item and label, so with many labels fewer items keep each
    mode to about what 16 (naive) and 256 items of an 8-label task cost."""
    labels = max(len(spec.labels), 8)
    return (naive or max(1, BENCH_NAIVE_ITEMS * 8 // labels), cached or max(16, BENCH_ITEMS * 8 // labels))
