"""The plan of a run: every check that needs no model, done before one loads (options, spec, the
whole input, the output, the fields to keep), and everything those checks settle, carried in
`Plan` so that nothing later decides it again. No torch here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from ..data.items import Item, ItemsDigest, detect_format, is_stream, read_items, scan_items
from ..data.output import check_distinct, check_output, check_report, output_format
from ..data.resume import file_digest, OutputFile
from ..data.records import Keep, columns, keep_clash
from ..errors import OutputError, SpecError, UsageError
from ..model.engines import Backend, backend_named, twin_backend
from ..model.load import dtype_name, model_identity, pick_device
from ..model.precision import precision_named
from ..reports.evaluation import Gates
from ..scoring.prepare import Batching, check_backend, spec_model
from ..scoring.options import exact_refusal
from ..task.overrides import with_overrides
from ..task.spec import TaskSpec
from ..task.specfile import read_spec_file, SpecFile
from .options import RunOptions, option_words
from .shards import launch_state, parse_shard, part_path

if TYPE_CHECKING:
    from accelerate import PartialState


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the checks before any model settle."""

    options: RunOptions
    spec: TaskSpec  # with the command line's overrides (--gold, -m, --revision)
    input_format: str
    stream: bool  # the input can be read only once (stdin, a pipe): never scanned before the run
    total: Optional[int]  # items to consider (after --limit); None for a stream
    output: OutputFile  # where this process writes (a part file in a launch), in which format and columns
    part: Optional[tuple[int, int]]  # (k, n), 0-based k: this process writes shard k of n
    launched: Optional[PartialState]  # a multi-process launch, or None
    keep: Keep  # input fields copied into each record (None: all)
    batching: Batching
    gates: Gates
    says_precision: bool  # records name their precision (--exact: a run that may mix two)
    device: str  # as asked ("auto", "cpu", ...): a launch's own device when launched
    scanned: Optional[ItemsDigest] = None  # the items the check read (up to --limit); None for a stream

    def read_input(self) -> Iterator[Item]:
        """The input's items, read afresh (a stream: the one read there is)."""
        return read_options_items(self.options, self.spec)

    def fingerprint(self) -> dict[str, Any]:
        """What an output file is tied to: continuing it with any of it changed is refused (the
        input may grow, or with --update change). The spec is the digest of the bytes read, so a
        spec given through a pipe is told from another."""
        o, device = self.options, pick_device(self.device)
        backend = run_engine(self.spec, o)
        precision = backend.precision(dtype_name(o.dtype, device))
        return {
            **spec_identity(self.spec, o.spec), "gold": self.spec.gold,
            "input": file_digest(o.items), "input_bytes": None if self.stream else os.path.getsize(o.items),
            "engine": backend.name, "engine_version": backend.version(precision), "device": device.split(":")[0],
            "dtype": precision,
            # its numbers move with the batch (quantised kernels): the batch options below are what reproduces them
            "scores_move_with_batch": backend.moves_with_batch(precision),
            "batch_size": o.batch_size, "batch_tokens": o.batch_tokens,
            "keep": "all" if self.keep is None else list(self.keep), "exact": o.exact,
            **({"gold_sep": self.spec.gold_sep} if self.spec.multi_label and self.spec.gold else {}),
            **({"prune": o.prune} if self.spec.prunes("on") and (o.prune != "auto" or self.spec.prunes("auto")) else {}),
            # whether records are pruned, whatever the words that said so: a resume never mixes the two
            **({"pruned": self.batching.pruned} if self.spec.prunes("on") else {}),
        }


def spec_identity(spec: TaskSpec, spec_path: Any) -> dict[str, Any]:
    """Which spec, model and head a run's answers came from, as its output's fingerprint says:
    the spec's digest (of the bytes read), the model's identity and the head's digest."""
    return {"spec": spec.digest or file_digest(str(spec_path)), "model": model_identity(spec_model(spec)),
            **({"head": spec.head.digest} if spec.head else {})}


def check_reads_states(spec: TaskSpec, o: RunOptions, why: str) -> None:
    """Refuse (UsageError), before any model loads, an engine that gives no hidden states where
    `why` (a fitted head, fit, suggest) reads them: it would fail only once the model was loaded."""
    backend = run_engine(spec, replace(o, exact=False))
    if not backend.reads_states:
        raise UsageError(f"{why} reads the model's hidden states, and the {backend.name} engine gives none: "
                         f"choose another with --backend")


def run_engine(spec: TaskSpec, o: RunOptions) -> Backend:
    """The engine a run scores with, as `load_engine` will pick it from the files alone (--exact:
    the engine of the float32 twin): part of what an output is, since two engines' numbers differ."""
    from ..model.choice import pick_engine
    from ..model.memory import float32_bytes

    if o.exact:
        return twin_backend()
    source = spec_model(spec)
    return backend_named(pick_engine(source, o.backend or spec.backend, o.device, o.dtype,
                                     float32_bytes=float32_bytes(source, o.cache_dir)).name)


log = logging.getLogger(__name__)
# From this many parameters, `--dtype auto` on a CPU with bfloat16 matrix instructions runs bfloat16
# with --exact. Measured: bfloat16 moved few calls of 0.5B and 1.5B models past their lead (1 of 99
# irony items re-scored, no support ticket of the 1.5B), and most of the 135M embedded model's
# (--exact would re-score over half its items, more than float32 alone costs).
AUTO_LOW_PRECISION_PARAMETERS = 300_000_000


def auto_precision(options: RunOptions, spec: TaskSpec) -> RunOptions:
    """`--dtype auto` resolved where it means more than float32: on a CPU with bfloat16 matrix
    instructions, for a model large enough that bfloat16 seldom moves its calls, bfloat16 with
    --exact (float32's labels), said in one line; otherwise the options as given."""
    from ..model.memory import RUNTIME, available_and_why, float32_bytes

    if options.dtype != "auto" or options.exact or spec.head is not None or pick_device(options.device) != "cpu":
        return options
    low = precision_named("bfloat16")
    if not low.pays("cpu"):
        return options
    size = float32_bytes(spec_model(spec), options.cache_dir)
    if size is None or size < 4 * AUTO_LOW_PRECISION_PARAMETERS:  # bfloat16 would move its calls too often
        return options
    if not run_engine(spec, options).float32_twin:  # llama.cpp: the file's own types
        return options
    free, _ = available_and_why()
    need = _both_precisions_bytes(spec, size) + RUNTIME
    if free is not None and need > free:  # both copies may be held: float32 alone is smaller
        log.info("dtype auto: float32 (bfloat16 with its float32 twin for close calls could need %.1f GB, more than "
                 "the %.1f GB available)", need / 1e9, free / 1e9)
        return options
    log.info("dtype auto: bfloat16, its close calls scored again in float32 (--exact): this CPU has %s, and a model "
             "of %.1fB parameters seldom has a call bfloat16 moves; --dtype float32 for float32 alone",
             low.unit, size / 4e9)
    return replace(options, dtype="bfloat16", exact=True)


def _both_precisions_bytes(spec: TaskSpec, float32_bytes: int) -> int:
    """The weights of a model in bfloat16 and its float32 twin: a GGUF file's kept weights, which
    the two share (model/keptload.py), or a bfloat16 and a float32 copy."""
    from ..model.memory import kept_weight_bytes

    source = spec_model(spec)
    kept = kept_weight_bytes(Path(source.path), 4) if source.kind == "gguf" else None
    return kept if kept is not None and kept < float32_bytes else int(float32_bytes * 1.5)


def refusal_words(key: str, value: Any) -> Optional[str]:
    """The option that gives a fingerprint's value ("--keep id,text", "--keep-all", "no --exact"),
    or None when the key is not an option's (the spec, the model)."""
    if key == "engine":
        return f"--backend {value}"
    if key == "pruned":
        return "--prune on" if value else "--prune off"
    if key == "keep":
        return option_words("keep_all", True) if value == "all" else option_words("keep", tuple(value or ()))
    return None if key == "model" else option_words(key, value)


def read_options_items(options: RunOptions, spec: TaskSpec) -> Iterator[Item]:
    """The items of `options.items`, read as the input options say (format, delimiter, encoding)."""
    fmt = detect_format(options.items, options.input_format)
    return read_items(options.items, fmt, spec.id_field, options.delimiter, options.encoding)


def load_options_spec(options: RunOptions, spec_file: Optional[SpecFile] = None) -> TaskSpec:
    """The options' spec (from `spec_file` when it was read already), with their overrides."""
    spec = (spec_file or read_spec_file(options.spec)).spec()
    return with_overrides(spec, options.gold, options.model, options.revision, options.gold_sep)


def make_plan(options: RunOptions) -> Plan:
    """Every check that needs no model: a mistake costs a second, not a model load."""
    _check_combinations(options)
    launched = launch_state(cpu=options.device == "cpu")
    part = (launched.process_index, launched.num_processes) if launched else (
        parse_shard(options.shard) if options.shard else None)
    stream = is_stream(options.items)
    if part and (stream or options.output in (None, "-")):
        raise OutputError("sharded and multi-process runs need an input file and an output file (-o)")
    _not_the_input(options, stream)
    spec = load_options_spec(options)
    _check_engine(options, spec)
    if spec.head is not None:
        check_reads_states(spec, options, f"{spec.path}'s head")
    options = auto_precision(options, spec)
    gates = Gates.parse(options.min_accuracy, options.min_recall, options.min_answered_accuracy)
    graded = [name for name, given in (("--metrics", options.metrics), ("--summary-md", options.summary_md),
                                       ("--junit", options.junit), ("--min-accuracy", options.min_accuracy),
                                       ("--min-recall", options.min_recall),
                                       ("--min-answered-accuracy", options.min_answered_accuracy)) if given is not None]
    if graded and not spec.has_gold:
        raise SpecError(f"{' and '.join(graded)} {'needs' if len(graded) == 1 else 'need'} a gold field "
                        + ("(a question's 'gold' in the spec, or --gold QUESTION=FIELD)" if spec.questions
                           else "('gold' in the spec, or --gold)"))
    gates.check(spec)
    fmt = detect_format(options.items, options.input_format)
    fields: dict[str, None] = {}
    total, scanned = (None, None) if stream else _scanned(options, spec, fmt, fields)
    out_fmt = output_format(options.output, options.output_format)
    keep = _keep(options, spec, fields, out_fmt, stream)
    check_output(options.output, options.resume or options.update, options.overwrite, out_fmt)
    _review_possible(options, stream, part)
    _check_reports(options, spec, stream)
    path = options.output
    if launched and part and path is not None:  # a launch has both (refused above otherwise)
        path = part_path(path, *part)
        check_output(path, options.resume or options.update, options.overwrite, out_fmt)
    pruned = spec.prunes(options.prune, options.exact)  # decided once: the scorer is built by the same rule
    output = OutputFile(path, out_fmt, columns(spec, keep or (), precision=options.exact, pruned=pruned),
                        spec.id_field if spec.id_field_given else "id")
    device = str(launched.device) if launched and options.device == "auto" else options.device
    batching = Batching(size=options.batch_size, tokens=options.batch_tokens, on_error=options.on_error, pruned=pruned
                        ).answering(spec, spec.head_alone(options.prompt_scores))
    return Plan(options=options, spec=spec, input_format=fmt, stream=stream, total=total, output=output, part=part,
                launched=launched, keep=keep, batching=batching, gates=gates, says_precision=options.exact,
                device=device, scanned=scanned)


def _scanned(options: RunOptions, spec: TaskSpec, fmt: str, fields: dict[str, None]) -> tuple[int, ItemsDigest]:
    """The whole input validated before the model loads: its item count (up to --limit) and
    digest; `fields` gathers the fields its items have."""
    check = spec.check_record if options.on_error == "fail" else (lambda record: None)
    scanned = ItemsDigest(options.limit)
    total = scan_items(options.items, fmt, spec.id_field, check, spec.id_field_given, fields, options.delimiter,
                       options.encoding, scanned)
    return (min(total, options.limit) if options.limit else total), scanned


def _check_engine(options: RunOptions, spec: TaskSpec) -> None:
    """The engine asked for (an unknown one refused first, naming the engines there are) and what
    --exact needs (scoring/options.py: exact_refusal)."""
    check_backend(spec)
    if options.backend not in (None, "auto"):
        backend_named(options.backend)
    why = exact_refusal(spec, options.backend, options.dtype) if options.exact else None
    if why:
        raise UsageError(why)


def _check_combinations(options: RunOptions) -> None:
    if options.on_error not in ("fail", "skip"):
        raise UsageError(f"--on-error must be fail or skip, not {options.on_error!r}")
    if (options.resume or options.update) and options.output in (None, "-"):
        raise OutputError(f"{'--update' if options.update else '--resume'} needs an output file (-o)")
    if options.overwrite and (options.resume or options.update):
        raise OutputError(f"--overwrite starts the output again; {'--update' if options.update else '--resume'} "
                          f"continues it: give one of them")


def _keep(options: RunOptions, spec: TaskSpec, fields: dict[str, None], out_fmt: str, stream: bool) -> Keep:
    """The input fields each record carries: those named with --keep, or with --keep-all every
    field the input has (None for a stream written as JSONL: each item's own)."""
    if options.keep and options.keep_all:
        raise UsageError("give --keep FIELD,... or --keep-all, not both")
    if options.keep_all and stream:
        if out_fmt == "csv":
            raise UsageError("--keep-all with CSV output needs the columns before the first row: name them with --keep "
                             "(input read once is not scanned)")
        return None
    names = list(fields) if options.keep_all else list(dict.fromkeys(options.keep))
    names = [name for name in names if name != spec.id_field]  # the id is there already
    for name in names:
        clash = keep_clash(spec, name, csv=out_fmt == "csv")
        if clash:
            raise UsageError(f"cannot keep input field {name!r}: {clash}; rename it in the input")
        if fields and name not in fields:
            raise UsageError(f"--keep {name}: no item has this field; the items' fields are "
                             f"{', '.join(map(repr, fields))}")
    return tuple(names)


def _check_reports(options: RunOptions, spec: TaskSpec, stream: bool) -> None:
    """Every report file writable, none of them a file the run reads or another writes, and
    --review replacing a file only as `_review_overwrites` says."""
    for what, report in (("--metrics", options.metrics), ("--summary-md", options.summary_md), ("--junit", options.junit),
                         ("--review", options.review)):
        check_report(report, what)
    _review_overwrites(options)
    check_distinct({"--metrics": options.metrics, "--summary-md": options.summary_md, "--junit": options.junit,
                    "--review": options.review, "-o": options.output},
                   {"the input": None if stream else options.items, "the spec": options.spec,
                    "the spec's head": spec.head.path if spec.head is not None else None}, outputs=("-o",))


def _review_overwrites(options: RunOptions) -> None:
    """--review replaces a file that exists only with --overwrite, or when continuing an output
    (--resume, --update: the earlier run's review is written again, whole): a labelled file named
    by mistake is never lost."""
    review = options.review
    if review is not None and review.exists() and not (options.overwrite or options.resume or options.update):
        raise OutputError(f"--review {review}: already exists; use --overwrite to replace it")


def _review_possible(options: RunOptions, stream: bool, part: object) -> None:
    """--review is written from the complete output joined with the input read again."""
    if options.review is None:
        return
    if stream or options.output in (None, "-") or part:
        raise UsageError("--review writes the abstained items from the output file and the input read again: give "
                         "an input file and an output file (-o), in one process")


def _not_the_input(options: RunOptions, stream: bool) -> None:
    """Writing the output must never destroy the input (the same file, a link to it included)."""
    if stream or options.output in (None, "-"):
        return
    try:
        same = Path(options.output).exists() and Path(options.output).samefile(options.items)
    except OSError:
        same = False
    if same:
        raise OutputError(f"{options.output}: is the input file {options.items}; write the output to another file")
