"""What the command line shows after a command: the run's summary line, evaluation tables, the
dry run's totals, the bench tables, the diff and the cache listing. Rich, on the console it is
given (stderr for everything but the tables a command exists to print). Not the HTML report:
that is reports/htmlpage.py."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import shown
from ..reports.evaluation import Evaluation, TagEvaluation
from ..reports.questions import QuestionsEvaluation, kind_figures
from ..reports.diff import QuestionsComparison

if TYPE_CHECKING:  # the bench and the scorer bring torch; these printers only read their figures
    from ..reports.diff import Comparison
    from ..run.bench import BenchReport, PrecisionReport, PruningResult, QuestionsResult
    from ..run.dryrun import DryRun
    from ..run.job import RunResult
    from ..scoring.scorer import Rescoring
    from ..labelled.fit import FitResult
    from ..tune.job import TuneResult
    from ..labelled.suggest import SuggestResult


def stamp() -> str:
    """The start of a line in a log read later: the time and the program."""
    return f"{time.strftime('%Y-%m-%d %H:%M:%S')} prefixcache: "


def print_summary(console: Console, result: RunResult, stamped: bool = False) -> None:
    """One line on what a run did (a RunResult); `stamped` (for logs): a timestamp and
    "done:", the output and the count of each label written."""
    s, r = result.stats, result
    head = stamp() if stamped else ""
    if r.nothing_to_do:
        errors = f" ({r.carried_errors} of them error records: --update tries those items again)" if r.carried_errors else ""
        console.print(f"{head}nothing to do: {r.output} already holds all {r.resumed} records{errors}", markup=False,
                      soft_wrap=True)
        return
    if stamped:
        counts = ", ".join(f"{label} {n}" for label, n in r.labels.most_common())
        head += f"done: {s.items + r.kept} records to {r.output or 'stdout'}{f' ({counts})' if counts else ''}; "
    label = f"shard {r.shard[0] + 1}/{r.shard[1]}: " if r.shard else ""
    kept = f"{r.kept} unchanged items kept, {r.dropped} dropped, " if r.kept or r.dropped else ""
    reused = s.items - s.errors - s.scored
    console.print(
        f"{head}{label}{f'{r.resumed} items already done, ' if r.resumed else ''}{kept}"
        f"{s.items} items in {s.seconds:.2f} s ({s.items_per_second:.1f} items/s, "
        f"{s.ms_per_item:.1f} ms/item, {s.item_tokens / max(s.scored, 1):.1f} tokens/item"
        f"{f', {reused} duplicates reused' if reused > 0 else ''}) · "
        f"prefix {r.prefix_tokens} tokens {r.prefix_source} in {r.prefill_ms:.0f} ms · "
        f"load {r.load_seconds:.1f} s · first record after {r.first_record or 0:.1f} s · {r.model} · {r.device} {r.dtype}"
        f"{f' · {s.errors} items failed (error records written)' if s.errors else ''}"
        f"{f' · {r.carried_errors} error records of an earlier run kept' if r.carried_errors else ''}"
        f"{_rescored(r.rescored) if r.rescored else ''}",
        markup=False,
        soft_wrap=True,
    )


def _per_label_table(console: Console, evaluation: Evaluation | TagEvaluation) -> None:
    table = Table("label", "precision", "recall", "F1", "support")
    for label, st in evaluation.per_label().items():
        table.add_row(_plain(label), f"{st['precision']:.3f}", f"{st['recall']:.3f}", f"{st['f1']:.3f}", str(st["support"]))
    print_table(console, table)


def _rescored(figures: Rescoring) -> str:
    from ..scoring.exact import bound_text  # a run with --exact: torch is loaded already

    share = figures.rescored / figures.scored if figures.scored else 0.0
    beyond = f", {figures.beyond} moved further than it" if figures.beyond else ""
    return (f" · {figures.rescored} of {figures.scored} items re-scored in float32 ({share:.0%}; "
            f"{bound_text(figures.bound)}{beyond})")


def print_evaluation(console: Console, evaluation: Evaluation | TagEvaluation | QuestionsEvaluation) -> None:
    if isinstance(evaluation, QuestionsEvaluation):
        table = Table("question", "type", "accuracy", "figures", "ECE")
        for qid, v in evaluation.per_question().items():
            table.add_row(_plain(qid), v["type"], f"{v['accuracy']:.3f}", kind_figures(v), f"{v.get('ece', 0.0):.3f}")
        console.print(f"{evaluation.n} items with gold answers" + (f", {evaluation.failed} failed" if evaluation.failed
                                                                   else ""), markup=False, soft_wrap=True)
        print_table(console, table)
        return
    if not isinstance(evaluation, Evaluation):  # multi-label
        console.print(evaluation.headline(), markup=False, soft_wrap=True)
        _per_label_table(console, evaluation)
        return
    head = f"accuracy {evaluation.accuracy:.3f} ({evaluation.correct}/{evaluation.n}) · coverage {evaluation.coverage:.3f}"
    if evaluation.labels is None:
        console.print(head, markup=False, soft_wrap=True)
        return
    console.print(f"{head} · macro-F1 {evaluation.macro_f1:.3f}", markup=False, soft_wrap=True)
    _per_label_table(console, evaluation)
    columns, rows = evaluation.matrix()
    if len(columns) > MATRIX_COLUMNS:  # a matrix this wide is unreadable on a line: its largest cells instead
        _top_confusions(console, evaluation, len(columns))
        return
    confusion = Table("gold \\ predicted", *map(_plain, columns))
    for label, row in zip(evaluation.labels, rows):
        confusion.add_row(_plain(label), *map(str, row))
    print_table(console, confusion)


MATRIX_COLUMNS = 12  # predicted labels from which the confusion matrix is shown as its largest cells
TOP_CONFUSIONS = 10


def _top_confusions(console: Console, evaluation: Evaluation, columns: int) -> None:
    """The most frequent mistakes (gold -> predicted, count), for a confusion matrix too wide to print."""
    cells = sorted(((n, g, p) for (g, p), n in evaluation.confusion.items() if g != p and n),
                   key=lambda c: (-c[0], c[1], c[2]))[:TOP_CONFUSIONS]
    if not cells:
        return
    table = Table("gold", "predicted", "items", title=f"most frequent confusions ({columns} labels: the whole "
                                                         f"matrix is in --metrics and prefixcache report)")
    for n, gold, predicted in cells:
        table.add_row(_plain(gold), _plain(predicted), str(n))
    print_table(console, table)


def print_table(console: Console, table: Table) -> None:
    """A table at a terminal's width; in a log (cron, CI) at its natural width, so no label is cut."""
    if console.is_terminal:
        console.print(table)
        return
    natural = console.measure(table, options=console.options.update_width(100_000)).maximum
    width = console.width
    console.width = max(width, natural)
    try:
        console.print(table)
    finally:
        console.width = width


def print_bench(report: BenchReport) -> None:
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"prefixcache bench · {report.device} {report.dtype} · {report.threads} threads")
    for col in ("mode", "items", "ms/item", "items/s", "speed-up", "efficiency", "peak RSS MB"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for m in report.modes + ([report.head_alone] if report.head_alone else []):
        about = "~" if m.estimated else ""
        table.add_row(
            m.mode + (" (estimated)" if m.estimated else ""), str(m.items), f"{about}{m.ms_per_item:.1f}",
            f"{about}{m.items_per_second:.1f}", f"{about}{m.speedup:.1f}x",
            "-" if m.efficiency is None else f"{about}{m.efficiency:.2f}",
            "-" if m.peak_rss_mb is None else f"{m.peak_rss_mb:.0f}",
        )
    out.print(table)
    from ..model.precision import find

    counted = find(report.dtype)
    out.print(
        (f"{report.dtype} matmul peak {report.peak_gflops:.0f} {counted.peak_unit if counted else 'GFLOP'}/s · "
         if report.peak_gflops else "") + f"unavoidable work {report.unavoidable_gflop:.2f} GFLOP/item "
        f"({report.item_tokens:.1f} item tokens + {report.candidate_tokens:.1f} label tokens) · "
        f"prefix {report.prefix_tokens} tokens, prefill {report.prefill_ms:.0f} ms · load {report.load_seconds:.1f} s\n"
        f"run pipeline vs one full forward per item and label: {'~' if report.modes[1].estimated else ''}"
        f"{report.modes[1].ms_per_item / report.modes[-1].ms_per_item:.0f}x · "
        f"scoring every label costs {report.option_cost_ratio:.2f}x scoring the item alone "
        f"(unavoidable work: {report.option_cost_floor:.2f}x) · "
        f"same labels in every mode: "
        f"{'yes' if report.same_labels else f'NO ({report.items_differing} of {report.items_compared} items differ)'}\n"
        f"prefix store: loading the {report.prefix_tokens}-token prefix takes {report.store_load_ms:.0f} ms, "
        f"prefilling it {report.store_prefill_ms:.0f} ms ({report.store_prefill_ms / max(report.store_load_ms, 1e-6):.0f}x)",
        soft_wrap=True,
    )
    if report.head_alone is not None:
        out.print(f"the fitted head alone: {report.head_alone.ms_per_item:.1f} ms/item, "
                  f"{report.modes[-1].ms_per_item / report.head_alone.ms_per_item:.1f}x faster than scoring every "
                  f"option (the pipeline above), its labels the head's own", soft_wrap=True)
    if report.first_token is not None:
        first, pipeline = report.first_token, report.modes[-1]
        ratio = first.ms_per_item / pipeline.ms_per_item
        out.print(f"{first.mode}: {first.ms_per_item:.1f} ms/item; the run pipeline, which scores every token of "
                  f"every label, takes {1 / ratio:.2f}x its time ({'faster' if ratio > 1 else 'slower'}); ranked by "
                  f"first tokens, {report.first_token_differing} of {first.items} items get another label",
                  soft_wrap=True)
    if report.questions is not None:
        _print_questions_bench(out, report.questions)
    if report.pruning is not None:
        _print_pruning_bench(out, report.pruning)


def _print_pruning_bench(out: Console, p: PruningResult) -> None:
    """bench on a task pruning applies to: every candidate scored against each pruned mode."""
    one = p.what[:-1]
    table = Table(title=f"pruned scoring · {p.labels} {p.what} · {p.items} items")
    for col in (f"{one} scoring", "ms/item", "speed-up", "candidate tokens/item", f"{p.what} left at a bound/item",
                "largest probability difference"):
        table.add_column(col, justify="left" if col == f"{one} scoring" else "right")
    table.add_row(f"every {one} to the end (--prune auto, off)", f"{p.full_ms:.1f}", "1.00x",
                  f"{p.full_label_tokens:.1f}", "0", "0")
    for mode, r in p.races.items():
        table.add_row(f"--prune {mode}", f"{r.ms:.1f}", f"{p.full_ms / r.ms:.2f}x", f"{r.label_tokens:.1f}",
                      f"{r.left:.1f}", f"{r.prob_gap:.1e}")
    out.print(table)
    out.print(f"same {'answers' if p.what == 'options' else 'labels'} every way: "
              + ("yes" if p.same_labels else "NO (" + ", ".join(f"--prune {m}: {r.items_differing} items differ"
                                                                 for m, r in p.races.items()) + ")"), soft_wrap=True)
    fastest = min(p.races, key=lambda m: p.races[m].ms)
    if p.races[fastest].ms < p.full_ms:
        out.print(f"--prune {fastest} is the fastest here ({p.full_ms / p.races[fastest].ms:.2f}x)", soft_wrap=True)
    else:
        out.print(f"pruning does not pay here: the default (--prune auto) scores every {one}", soft_wrap=True)


def _print_questions_bench(out: Console, q: QuestionsResult) -> None:
    """bench on typed questions: all of them in one pass a batch against each in a pass of its own."""
    table = Table(title=f"typed questions · {q.questions} questions · {q.items} items of {q.item_tokens:.0f} tokens")
    for col in ("asked", "ms/item"):
        table.add_column(col, justify="left" if col == "asked" else "right")
    table.add_row(f"all {q.questions} together (one pass a batch, as run asks them)", f"{q.together_ms:.1f}")
    for qid, ms in q.alone_ms.items():
        table.add_row(f"{_plain(qid)} alone", f"{ms:.1f}")
    table.add_row(f"each alone, {q.questions} passes", f"{q.alone_total_ms:.1f}")
    out.print(table)
    out.print(f"{q.questions} questions together cost {1 / q.ratio:.2f}x asking them one at a time: {q.ratio:.2f}x "
              f"faster · the same numbers: largest log-prob difference {q.max_difference:.1e}", soft_wrap=True)


def print_cache(root: Path, prefixes: list[dict], models: list[dict]) -> None:
    """`cache list`: the stored prefixes as a table, then the converted models (stdout)."""
    table = Table("fingerprint", "model", "prefix tokens", "size MB", "last used", title=f"prefix store: {_plain(root)}")
    for row in prefixes:
        table.add_row(row["fingerprint"], _plain(row["model"]), str(row["prefix_tokens"]), f"{row['size_mb']:.1f}",
                      row["last_used"])
    out = Console(highlight=False)
    out.print(table)
    for m in models:
        out.print(f"converted model: {m['path']} (from {m.get('source')})", soft_wrap=True)


def print_dry_run(console: Console, dry: DryRun) -> None:
    """`run --dry-run`: one JSON line per item on stdout, the totals and the estimate on stderr."""
    for item in dry.items:
        sys.stdout.write(json.dumps(item, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    n = len(dry.items)
    continued = {"resume": f"the output holds {dry.written} items already; resumed, the run scores the rest · ",
                 "grown": f"the output holds {dry.written} items already; the input grew, the run scores the rest · ",
                 "update": "the output would be updated: unchanged items' records kept, the others scored (counted "
                           "here as all) · ", "fresh": ""}.get(dry.continued, "")
    console.print(
        f"dry run: {continued}{n} items to score{f' ({dry.failed} cannot be scored)' if dry.failed else ''} · prefix "
        f"{dry.prefix_tokens} tokens, encoded once · {dry.item_tokens} item tokens ({dry.item_tokens / max(n, 1):.1f} "
        f"per item) + "
        + (f"{dry.label_tokens} answer-position tokens (the fitted head answers alone: no option is scored)\n"
           if dry.head_alone else f"{dry.label_tokens} label tokens to score\n") +
        f"measured on {dry.measured} items: {dry.ms_per_item:.1f} ms/item · estimated {_duration(dry.estimate_seconds)} "
        f"for all {n} (plus about {dry.load_seconds:.0f} s to load) · nothing was written"
        + (f"\n{dry.pruning}" if dry.pruning else ""),
        markup=False, soft_wrap=True,
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 90 else f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def print_precision_bench(report: PrecisionReport) -> None:
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    r = report
    table = Table(title=f"prefixcache bench --exact · {r.items} items")
    for col in ("mode", "ms/item", "speed-up over float32", "labels differing from float32"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    table.add_row("float32", f"{r.float32_ms:.1f}", "1.00x", "-")
    table.add_row(r.dtype, f"{r.fast_ms:.1f}", f"{r.float32_ms / r.fast_ms:.2f}x", str(r.labels_differ_fast))
    table.add_row(f"{r.dtype} --exact", f"{r.exact_ms:.1f}", f"{r.float32_ms / r.exact_ms:.2f}x", str(r.labels_differ_exact))
    out.print(table)
    from ..scoring.exact import bound_text  # the bench loaded torch already

    out.print(f"--exact re-scored {r.rescored} of {r.items} items in float32 ({r.rescored / max(r.items, 1):.0%}), "
              f"{bound_text(r.bound)} · it holds a float32 copy of the weights too: +{r.extra_weights_mb:.0f} MB",
              soft_wrap=True)


def print_diff(console: Console, cmp: Comparison | QuestionsComparison, name_a: str, name_b: str, top: int = 10) -> None:
    """`prefixcache diff`: counts, the flips, the changed items, the largest shifts, the accuracy
    (typed questions: question by question)."""
    if isinstance(cmp, QuestionsComparison):
        for qid, one in cmp.per_question.items():
            console.rule(f"question {_plain(qid)}", style="bold")
            print_diff(console, one, name_a, name_b, top)
        return
    console.print(f"{cmp.both} items in both · {len(cmp.changed)} changed ({cmp.change_rate:.1%})"
                  + (f" · only in {name_a}: {len(cmp.only_a)}" if cmp.only_a else "")
                  + (f" · only in {name_b}: {len(cmp.only_b)}" if cmp.only_b else ""), markup=False, soft_wrap=True)
    if not cmp.same_labels:
        console.print(f"different label sets: {name_a} {cmp.labels_a}, {name_b} {cmp.labels_b}; probabilities are "
                      f"compared on the labels they share", markup=False, soft_wrap=True)
    if cmp.gold:
        console.print(f"accuracy {cmp.accuracy_a:.3f} → {cmp.accuracy_b:.3f} ({cmp.accuracy_b - cmp.accuracy_a:+.3f}) · "
                      f"fixed {len(cmp.fixed)} · broken {len(cmp.broken)} · McNemar exact p = {cmp.p_value:.3g}",
                      markup=False, soft_wrap=True)
    if cmp.per_label:
        head = ["label", "turned on", "turned off"] + (["fixed", "broken", "McNemar p"] if cmp.gold else [])
        table = Table(*head, title="per label")
        for name, f in cmp.per_label.items():
            extra = [str(f["fixed"]), str(f["broken"]), f"{f['mcnemar_p']:.3g}"] if cmp.gold else []
            table.add_row(_plain(name), str(f["turned_on"]), str(f["turned_off"]), *extra)
        console.print(table)
    if cmp.flips:
        shown = cmp.flips.most_common(top)
        more = len(cmp.flips) - len(shown)
        flips = Table("from", "to", "items", title="label changes", caption=f"and {more} more pairs" if more else None)
        for (a, b), n in shown:
            flips.add_row(_plain(a), _plain(b), str(n))
        console.print(flips)
    for title, every in (("changed items", cmp.changed), ("largest confidence shifts", cmp.shifts)):
        rows = every[:top]
        if not rows:
            continue
        kept = list(rows[0].kept)[:3]
        caption = f"the first {top} of {len(every)}: --top N lists more" if len(every) > top else None
        table = Table("id", _plain(name_a), _plain(name_b), f"p({_plain(name_a)}'s label)", "shift", *map(_plain, kept),
                      title=title, caption=caption)
        for c in rows:
            after = None if c.prob_a is None else c.prob_a + c.shift
            table.add_row(_plain(c.id), _plain(c.label_a), _plain(c.label_b),
                          "-" if c.prob_a is None else f"{c.prob_a:.3f} → {after:.3f}",
                          f"{c.shift:+.3f}", *(_plain(c.kept.get(k, "")) for k in kept))
        console.print(table)


def _plain(value: object) -> str:
    """A value from the data (an id, a label, a file name) shown as it is: never read as markup,
    its control characters escaped (they could clear or recolour the terminal)."""
    return "-" if value is None else escape(shown(value))


def print_drift(console: Console, drift: Any) -> None:
    """`drift`'s tests as a table (stdout): each one's p-value, the PSI of shares, the figures."""
    table = Table("test", "p", "PSI", "what", title=f"{escape(drift.current)} ({drift.n_current} items) against "
                  f"{escape(drift.reference)} ({drift.n_reference}): alarm below p={drift.cut:.2g}",
                  title_justify="left")
    for t in drift.tests:
        fired = t in drift.fired
        table.add_row(("[bold red]" if fired else "") + escape(t.name), f"{t.p:.3g}",
                      "-" if t.psi is None else f"{t.psi:.3f}", escape(t.words))
    console.print(table)
    before, after = drift.estimates
    if before is not None and after is not None:
        console.print(f"estimated accuracy of the answered items: {after.words()} "
                      f"against {before.words()}", soft_wrap=True)
    for change in drift.changed:
        console.print(f"changed: {escape(change)}", soft_wrap=True)


def rendered_text(rendered: dict, decode: Callable[[list[int]], Any]) -> str:
    """`render --text`: one item's prompt as a person reads it: the cached prefix, a marked line
    where the item's own tokens start, the item's part, and each candidate's text and tokens."""
    ids, cut = rendered["prompt_ids"], rendered["prefix_len"]
    prefix, own = decode(ids[:cut]), decode(ids[cut:])
    candidates = "\n".join(f"  {name!r}: {decode(c)!r} ({len(c)} token{'s' if len(c) != 1 else ''})"
                           for name, c in rendered["candidates"].items())
    if "labels" in rendered:  # forms of a label, or a multi-label question's yes and no
        candidates += "\n----- labels, each scored by its candidates above -----\n" + "\n".join(
            f"  {label!r}: {' | '.join(map(repr, texts))}" for label, texts in rendered["labels"].items())
    if "options" in rendered:  # a question's options, each scored by its texts above
        candidates += "\n----- options, each scored by the texts above -----\n" + "\n".join(
            f"  {option!r}: {' | '.join(map(repr, texts))}" for option, texts in rendered["options"].items())
    asked = f" · question {rendered['question']!r} ({rendered['type']})" if "question" in rendered else ""
    after = "after the question" if asked else "after the item"
    return (f"=== item {rendered['id']}{asked} ===\n{prefix}"
            f"\n----- cached prefix above ({cut} tokens), the item's own {len(ids) - cut} tokens below -----\n"
            f"{own}\n----- candidates, scored {after} -----\n{candidates}\n\n")


def suggest_summary(result: SuggestResult) -> str:
    """What suggest chose, in one line (stderr): how many of how many, on what grounds, and where."""
    plan, n = result.plan, len(result.picked)
    scored = len(plan.pool) - result.skipped
    line = f"suggested {n} of {scored:,} unlabelled item{'s' if scored != 1 else ''}"
    if plan.left_out:
        line += f" ({plan.left_out:,} labelled already left out)"
    if plan.copies:
        line += f" ({plan.copies:,} copies of a text offered once)"
    if result.audited:
        return (f"suggested {n} of the {len(plan.pool):,} items the run answered ({plan.unanswered:,} it abstained on "
                f"or did not answer left out): drawn at random (picked_by: audit); fill in the gold column, then run "
                f"the spec on the file with --min-answered-accuracy · wrote {', '.join(map(str, result.written))}")
    if result.drawn:
        return line + (f": drawn at random (picked_by: random), so that fit estimates on rows like those it will "
                       f"answer; fill in the gold column · wrote {', '.join(map(str, result.written))}")
    if result.pool_margin is not None:
        picked = sorted(r["margin"] for r in result.picked)
        line += (f": the head's least sure, spread over the states (median margin {picked[len(picked) // 2]:.3f}, "
                 f"the pool's {result.pool_margin:.3f}); the gold column holds its guess: correct it")
    else:
        line += ": no head yet, so a seed set spread over the model's states; fill in the gold column"
    if result.skipped:
        line += f"; {result.skipped} too long to score, left out"
    return line + f" · {result.ms_per_item:.0f} ms/item · wrote {', '.join(map(str, result.written))}"


def print_fit(result: FitResult) -> None:
    """fit's findings, one block on stderr whether or not it is a terminal (the figures' JSON file
    is the data): per question the head and the prompt alone on the same held-out folds, the gain,
    the verdict, the learning curve and anything said about the counts."""
    out = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
    o = result.options
    for j in result.judged:
        kind = "exact label sets" if j.binary else "accuracy"
        table = Table(title=f"prefixcache fit · {escape(j.qid)} · {j.folds}-fold cross-validation over "
                            f"{j.counted}", title_justify="left")
        for col in ("readout", kind, "macro-F1", "ECE"):
            table.add_column(col, justify="left" if col == "readout" else "right")
        blind = 2 * j.unseen >= j.items  # most held-out rows' answers were in no training fold
        for name, f in (("head", j.head), ("prompt alone", j.prompt)):
            accuracy = "not estimable (see the note)" if blind and name == "head" else _interval(f["accuracy"])
            table.add_row(name, accuracy, _interval(f["macro_f1"]), f"{f['ece']:.3f}",
                          style="bold" if (name == "head") == (j.verdict == "head") and j.verdict != "tie" else None)
        if j.baseline:  # no language model: what the head must beat to be worth it
            b = j.baseline
            table.add_row("TF-IDF + LR", _interval(b["accuracy"]), _interval(b["macro_f1"]), f"{b['ece']:.3f}",
                          style="dim")
        out.print(table)
        g = j.gain
        out.print(f"gain in {kind}: {g.value:+.3f} [{g.low:+.3f}, {g.high:+.3f}] (98%): {j.verdict_words}")
        out.print(f"head: C={j.choice.C:g}, reads {reads_words(j.choice.features)} (chosen by inner cross-validation)")
        if j.curve:
            out.print("learning curve (held-out accuracy by labelled items a class): "
                      + ", ".join(f"{c['per_class']}: {c['accuracy']:.3f}" for c in j.curve))
        if j.since is not None:
            a, g = j.since.accuracy, j.since.gain
            out.print(f"since the last fit ({j.since.items} of these items, the same folds): {kind} {_interval(a)} "
                      f"then, {_interval(j.head['accuracy'])} now; gain {g.value:+.3f} [{g.low:+.3f}, {g.high:+.3f}] (98%)")
        if j.thresholds:
            out.print("thresholds: " + ", ".join(f"{escape(k)} {t:.2f}" for k, t in zip(j.counts, j.thresholds)))
        if j.cut is not None:
            _print_cut(out, j)
        for note in j.notes:
            out.print(f"note: {escape(note)}")
    items = len(result.plan.items)
    read = f"{result.ms_per_item:.1f} ms/item" if result.kept < items else "none scored"
    kept = f" ({result.kept} of {items} items read back from an earlier fit)" if result.kept else ""
    scored = ""
    if result.read.scored.any():
        m = int(result.read.scored.sum())
        scored = (f"; options scored for {m} item{'s' if m != 1 else ''}"
                  + (f" ({result.read.prompt_ms_per_item:.1f} ms/item)" if result.read.prompt_ms_per_item else ""))
    out.print(f"reading states: {read}{kept}{scored}; fitted spec: {escape(str(o.output))}")


def reads_words(features: str) -> str:
    """A feature set (task/features.py) in words."""
    from ..task.features import Features, layer_of

    f = Features.parse(features)
    words = [("the state at the answer" if v.startswith("state") else "the mean over the item's tokens")
             + (f" of layer {layer_of(v)}" if layer_of(v) else "") for v in f.views]
    return ", ".join(words) + (" and the options' log-probabilities" if f.logprobs else "") + f" ({features})"


def _print_cut(out: Console, j: Any) -> None:
    """The risk-coverage table of a question's held-out predictions and the cut chosen in it."""
    from ..labelled.cutpoint import least_items

    cut, level = j.cut, f"{j.cut.confidence:.0%}"
    table = Table(title=f"risk-coverage · {escape(j.qid)} · held out · {level} bounds", title_justify="left")
    for col in ("abstain below", "answered", "coverage", "accuracy", "low", "high"):
        table.add_column(col, justify="right")
    for r in cut.table:
        table.add_row(f"{r.cut:.3f}", str(r.answered), f"{r.coverage:.0%}", f"{r.accuracy:.3f}", f"{r.low:.3f}",
                      f"{r.high:.3f}", style="bold" if r is cut.chosen else None)
    out.print(table)
    if cut.chosen is not None:
        r = cut.chosen
        aim = (f"at least {cut.target:g} at {level} confidence" if cut.target is not None
               else f"{r.coverage:.0%} answered, as --coverage {cut.coverage:g} asks")
        if r.answered == r.total and not cut.per_option:
            out.print(f"cut: none: every item answered, with accuracy {r.accuracy:.3f} [{r.low:.3f}, {r.high:.3f}] "
                      f"({aim}); no threshold written for {escape(j.qid)} (new items are all answered)")
            return
        out.print(f"cut: abstain below {r.cut:.3f}: answers {r.coverage:.0%} of the items with accuracy {r.accuracy:.3f} "
                  f"[{r.low:.3f}, {r.high:.3f}] ({aim}); written as {escape(j.qid)}'s threshold")
        _print_own_cuts(out, j, "with the threshold for the rest")
        return
    m = cut.missed
    by = (f": the most confident cut tested answers {m.coverage:.0%} with a lower bound of {m.low:.3f} "
          f"({cut.target - m.low:.3f} short)" if m else f": fewer than {least_items(cut.target, cut.confidence)} "
          f"items could be answered") + _to_certify(j)
    if cut.per_option:
        out.print(f"cut: no one cut reaches accuracy {cut.target:g} at {level} confidence on these {_on(j)}{by}")
        _print_own_cuts(out, j, "every other answer abstaining (threshold 1)")
        return
    out.print(f"cut: none reaches accuracy {cut.target:g} at {level} confidence on these {_on(j)}{by}; no "
              f"threshold written: label more items or lower the target")


def _on(j: Any) -> str:
    """What a cut was tested on, in words."""
    return f"{j.calibration} calibration rows" if j.calibration else j.counted


def _to_certify(j: Any) -> str:
    """When no cut is certified: the most the rows certify, and about how many rows drawn at
    random would certify the target at the accuracy measured."""
    from ..labelled.cutpoint import items_to_certify

    table, cut = j.cut.table, j.cut
    if not table:
        return ""
    best = max(table, key=lambda r: r.low)
    words = f"; the most these rows certify is {best.low:.3f} (answering {best.coverage:.0%})"
    need = items_to_certify(cut.target, table[-1].accuracy, cut.confidence)
    if need is None or not j.calibration:
        return words
    rows = int(math.ceil(need / max(j.calibration / max(j.texts or j.items, 1), 1e-9)))
    return words + (f"; at the accuracy measured ({table[-1].accuracy:.3f}) about {rows} labelled rows drawn at random "
                    f"({need} of them held out to certify) would certify it")


def _print_own_cuts(out: Console, j: Any, rest: str) -> None:
    """The answers with a cut of their own, and what all the cuts together answer held out."""
    cut = j.cut
    if not cut.per_option or cut.together is None:
        return
    own = ", ".join(f"{escape(list(j.counts)[k])} {o.cut:.3f} ({o.answered} answered, {o.accuracy:.3f}, low {o.low:.3f})"
                    for k, o in sorted(cut.per_option.items()))
    t = cut.together
    out.print(f"per-answer cuts where the data supports them: {own}; {rest}, they answer {t.coverage:.0%} with "
              f"accuracy {t.accuracy:.3f} [{t.low:.3f}, {t.high:.3f}] (kept in the head file)")


def print_tune(result: TuneResult, top: int) -> None:
    """tune's leaderboard (stdout): each configuration's held-out figures with their intervals,
    then the verdict and what `run` on the chosen spec gives."""
    from ..tune.leaderboard import cost, figure_name, reproduce, shown, threshold_text, verdict
    from ..tune.selection import measured

    s = result.selection
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    several = len({v.spec.model for v in result.variants}) > 1
    abstains = any(measured(row.figures["coverage"]).value < 1 for row in s.rows)
    table = Table(title=f"prefixcache tune · {escape(result.how)}", title_justify="left")
    thresholds = any(row.threshold is not None for row in s.rows)
    columns = ["#", "prompt", "rule"] + (["threshold"] if thresholds else []) + [figure_name(result, "accuracy")]
    columns += ["macro-F1"] if s.rows[0].figures["macro_f1"] is not None else []
    columns += ["coverage", "answered acc."] if abstains else []
    columns += ["chosen in", "ms/item", "extra passes"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("prompt", "rule", "threshold", "extra passes") else "right")
    for rank, row in shown(result, top):
        f = row.figures
        mark = " spec" if row is s.default else " ★" if row is s.pick and s.verdict == "winner" else ""
        cells = [f"{rank}{mark}", escape(result.variants[row.config.variant].name), row.config.rule.name]
        cells += [threshold_text(result, row)] if thresholds else []
        cells += [_interval(f["accuracy"])]
        cells += [_interval(f["macro_f1"])] if f["macro_f1"] is not None else []
        cells += [_value(f["coverage"]), _value(f["answered_accuracy"])] if abstains else []
        ms, extra = cost(result, row)
        cells += [f"{row.picked}/{s.splits}", f"{ms:.1f}", extra]
        table.add_row(*cells, style="bold" if mark.strip() == "★" else None)
    out.print(table)
    if several:
        out.print("models: " + ", ".join(dict.fromkeys(escape(str(v.spec.model or "the embedded default"))
                                                         for v in result.variants)), soft_wrap=True)
    out.print(verdict(result), markup=False, soft_wrap=True)
    out.print(reproduce(result), markup=False, soft_wrap=True)


def _interval(figure: Any) -> str:
    return f"{figure.value:.3f} [{figure.low:.2f}, {figure.high:.2f}]"


def _value(figure: Any) -> str:
    return "-" if figure is None else f"{figure.value:.3f}"
