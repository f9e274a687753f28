"""A tune's findings as words, JSON and Markdown (the terminal table is the CLI's). No torch."""

from __future__ import annotations

from typing import Any

from ..reports.markdown import cell, code
from ..task.decision import DEFAULT_CONTENT_FREE
from .job import TuneResult, describe, threshold_value
from .selection import Figure, Row, measured

FIGURE_NAMES = {"accuracy": "accuracy", "macro_f1": "macro-F1", "answered_accuracy": "answered accuracy",
                "coverage": "coverage"}


def figure_name(result: TuneResult, name: str) -> str:
    if name == "accuracy" and result.spec.multi_label:
        return "exact-set accuracy"
    return FIGURE_NAMES[name]


def verdict(result: TuneResult) -> str:
    """The finding in one or two sentences."""
    s = result.selection
    name = figure_name(result, s.goal.figure)
    default, tuned, gain = measured(s.default.figures[s.goal.figure]), measured(s.tuned[s.goal.figure]), s.gain
    if s.verdict == "spec":
        return (f"keep the spec as written: no configuration did better on these items "
                f"({name} {_ci(default)}; {result.how})")
    if s.verdict == "no winner":
        usual = max(s.rows, key=lambda r: r.picked)
        return (f"no winner: choosing by {_by(result)} scores {_ci(tuned)} held out (most often chosen: "
                f"{describe(result, usual.config)}), within noise of the spec as written ({default.value:.3f}): "
                f"gain {_signed(gain)} on {s.held_out} items; keep the spec, or label more items to tell them apart")
    return (f"pick: {describe(result, s.pick.config)} · held-out {name} {_ci(tuned)} against {default.value:.3f} "
            f"for the spec as written: gain {_signed(gain)} ({result.how})")


def reproduce(result: TuneResult) -> str:
    """What `run` on the tuned spec gives on the held-out items."""
    s = result.selection
    row = s.pick if s.verdict == "winner" else s.default
    name = figure_name(result, s.goal.figure)
    value = row.as_run[s.goal.figure]
    where = result.options.test if result.test_items is not None else result.options.run.items
    return f"run on {'the tuned spec' if s.verdict == 'winner' else 'the spec'} with {where} gives {name} {value:.4f}"


def _by(result: TuneResult) -> str:
    return "the labelled items" if result.test_items is not None else "cross-validation"


def _ci(f: Figure | None) -> str:
    return "-" if f is None else f"{f.value:.3f} [{f.low:.3f}, {f.high:.3f}]"


def _signed(f: Figure) -> str:
    return f"{f.value:+.3f} [{f.low:+.3f}, {f.high:+.3f}] (98% interval)"


def cost(result: TuneResult, row: Row) -> tuple[float, str]:
    """A row's scoring time per item, and the passes its rule adds to a run."""
    scored = result.scored[row.config.variant]
    rule, ms = row.config.rule, scored.ms_per_item
    extra = []
    if rule.normalize == "pmi" and result.spec.choices:
        ms += 1000 * scored.unconditional_seconds / max(scored.items, 1)
        extra.append("options content-free")
    elif rule.normalize == "pmi":
        extra.append("1 content-free pass")
    if rule.calibrate:
        extra.append(f"{len(result.spec.content_free or DEFAULT_CONTENT_FREE)} calibration inputs")
    return ms, " + ".join(extra) or "-"


def threshold_text(result: TuneResult, row: Row) -> str:
    t = row.threshold
    if t is None:
        return "-"
    if isinstance(t, (int, float)):
        return f"{t:g}" + (" fitted" if row.config.fitted else "")
    values = set(float(v) for v in t)
    text = f"{values.pop():g}" if len(values) == 1 else "per label"
    return text + (" fitted" if row.config.fitted else "")


def row_json(result: TuneResult, row: Row) -> dict[str, Any]:
    ms, extra = cost(result, row)
    variant = result.variants[row.config.variant]
    threshold = threshold_value(result.spec, row.threshold)
    return {
        "variant": variant.name, "model": variant.spec.model, "normalize": row.config.rule.normalize,
        "calibrate": row.config.rule.calibrate, "threshold": threshold, "threshold_fitted": row.config.fitted,
        **{name: (None if f is None else f.to_json()) for name, f in row.figures.items()},
        "as_run": row.as_run, "chosen_in": row.picked, "ms_per_item": round(ms, 3), "extra_passes": extra,
        "spec_as_written": row is result.selection.default, "pick": row is result.selection.pick,
    }


def to_json(result: TuneResult) -> dict[str, Any]:
    s = result.selection
    return {
        "task": result.kind, "goal": s.goal.figure, "min_coverage": s.goal.min_coverage, "how": result.how,
        "items": result.items, "test_items": result.test_items, "splits": s.splits, "held_out": s.held_out,
        "verdict": s.verdict, "message": verdict(result), "reproduce": reproduce(result),
        "tuned": {name: (None if f is None else f.to_json()) for name, f in s.tuned.items()},
        "gain": s.gain.to_json(), "pick": row_json(result, s.pick), "spec_as_written": row_json(result, s.default),
        "chosen_keys": result.chosen_keys, "written": None if result.written is None else str(result.written),
        "variants": [{"name": v.name, "model": v.spec.model, "sets": sorted(v.keys),
                      "prefix_tokens": sc.prefix_tokens, "ms_per_item": round(sc.ms_per_item, 3)}
                     for v, sc in zip(result.variants, result.scored)],
        "rows": [row_json(result, row) for row in s.rows],
    }


def to_markdown(result: TuneResult, top: int) -> str:
    """A CI step summary: the verdict and the leaderboard's first `top` rows (the spec as written
    and the pick always among them)."""
    s = result.selection
    lines = ["### prefixcache tune", "", f"spec {code(result.options.run.spec)} · {result.how}", "", verdict(result), ""]
    head = ["#", "prompt", "rule", "threshold", "accuracy", "macro-F1", "coverage", "chosen in", "ms/item"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank, row in shown(result, top):
        mark = " (spec)" if row is s.default else " ★" if row is s.pick and s.verdict == "winner" else ""
        f = row.figures
        lines.append("| " + " | ".join([
            f"{rank}{mark}", cell(result.variants[row.config.variant].name), row.config.rule.name,
            threshold_text(result, row), _ci(f["accuracy"]), _ci(f["macro_f1"]),
            f"{measured(f['coverage']).value:.3f}", f"{row.picked}/{s.splits}", f"{cost(result, row)[0]:.1f}"]) + " |")
    return "\n".join(lines) + "\n"


def shown(result: TuneResult, top: int) -> list[tuple[int, Row]]:
    """The leaderboard's first `top` rows with their ranks, and the spec as written and the pick
    after them when they rank lower."""
    s = result.selection
    ranked = list(enumerate(s.rows, 1))
    out = ranked[:top]
    out += [(rank, row) for rank, row in ranked[top:] if row is s.default or row is s.pick]
    return out



