"""`prefixcache report`: one self-contained HTML page about a run's output (no network, no scripts,
no fonts to fetch): summary, evaluation, figures drawn by matplotlib as inline SVG, the confident
mistakes and the closest calls, and optionally the diff with another run. No torch.

matplotlib is an optional extra (`pip install 'prefixcache[report]'`), imported only here.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import Any, Sequence

from .diff import Comparison, compare
from .. import safefile
from ..errors import InputError
from .evaluation import Evaluation, TagEvaluation, evaluate
from ..data.output import check_distinct, fingerprint_of, read_records
from ..data.records import Record, input_fields, is_error, question_ids, question_view

REPORT_EXTRA = "pip install 'prefixcache[report]'"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["text.parse_math"] = False  # a label like "$5 off $20" is text, not TeX
        matplotlib.rcParams["text.usetex"] = False
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(f"the HTML report draws its figures with matplotlib: {REPORT_EXTRA}")
    return plt


def _svg(fig: Any) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})  # the same run, the same page
    _pyplot().close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline: no XML prolog


def _confusion(plt: Any, ev: Evaluation) -> str:
    columns, rows = ev.matrix()
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(columns), 1.0 + 0.6 * len(rows)))
    ax.imshow(rows, cmap="Blues")
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), list(ev.labels or ()))
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    top = max((max(r) for r in rows if r), default=1) or 1
    for i, row in enumerate(rows):
        for j, n in enumerate(row):
            ax.text(j, i, str(n), ha="center", va="center", color="white" if n > top / 2 else "black")
    ax.set_title("confusion matrix")
    return _svg(fig)


def _per_label(plt: Any, ev: Evaluation | TagEvaluation) -> str:
    stats = ev.per_label()
    labels = list(stats)
    fig, ax = plt.subplots(figsize=(2 + 0.9 * len(labels), 3))
    width = 0.27
    for k, metric in enumerate(("precision", "recall", "f1")):
        ax.bar([i + (k - 1) * width for i in range(len(labels))], [stats[lab][metric] for lab in labels], width,
               label=metric)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylim(0, 1)
    for i, lab in enumerate(labels):  # a label no item has: say so, rather than draw nothing
        if not stats[lab]["support"]:
            ax.text(i, 0.5, "no items", ha="center", va="center", rotation=90, color="#666", fontsize="small")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")  # beside the bars, never on them
    ax.set_title("per label")
    return _svg(fig)


def _reliability(plt: Any, ev: Evaluation | TagEvaluation, confidence: str = "top probability",
                 title: str | None = None) -> str:
    fig, ax = plt.subplots(figsize=(3.6, 3.4))
    n = len(ev.bins)
    filled = [(k, b) for k, b in enumerate(ev.bins) if b[0]]
    ax.bar([(k + 0.5) / n for k, _ in filled], [b[2] / b[0] for _, b in filled], width=1 / n, edgecolor="black",
           alpha=0.7, label="accuracy" if isinstance(ev, Evaluation) else "share of yes in gold")
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    ax.set_xlabel(f"confidence ({confidence})")
    ax.set_ylabel("accuracy" if isinstance(ev, Evaluation) else "share of yes in gold")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(title or f"reliability · ECE {ev.ece:.3f}")
    return _svg(fig)


def _distributions(plt: Any, scored: Sequence[Record]) -> str:
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(7, 2.8))
    axes[0].hist([r["prob"] for r in scored if r.get("prob") is not None], bins=20, range=(0, 1), color="#4c72b0")
    axes[0].set_title("top probability")
    axes[1].hist([r["margin"] for r in scored], bins=20, range=(0, 1), color="#dd8452")
    axes[1].set_title("margin (top - second)")
    for ax in axes:
        ax.set_ylabel("items")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of items: whole numbers
    return _svg(fig)



def _tag_figures(plt: Any, ev: TagEvaluation | None, scored: Sequence[Record]) -> list[str]:
    """Multi-label: every label's P(yes) as a histogram; with gold, the per-label bars, the pooled
    reliability diagram and one per label (the first 12 labels)."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(3.6, 2.8))
    ax.hist([p for r in scored for p in r["probs"].values()], bins=20, range=(0, 1), color="#4c72b0")
    ax.set_title("P(yes), every label")
    ax.set_ylabel("item × label")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    figures = [_svg(fig)]
    if ev is None:
        return figures
    figures = [_per_label(plt, ev), _reliability(plt, ev, "P(yes), every label")] + figures
    for label in list(ev.labels)[:12]:
        single = TagEvaluation([label])
        single.bins = ev.label_bins[label]
        figures.append(_reliability(plt, single, "P(yes)", title=f"{label} · ECE {single.ece:.3f}"))
    return figures


def _table(title: str, rows: Sequence[Record], gold: bool) -> str:
    if not rows:
        return ""
    kept = list(dict.fromkeys(k for r in rows for k in input_fields(r)))[:4]
    tags = "labels" in rows[0]
    head = (["id", "labels"] if tags else ["id", "label", "prob", "margin"]) + (["gold"] if gold else []) + kept
    cells = [([r.get("id"), ", ".join(r["labels"])] if tags else [r.get("id"), r.get("label"), r.get("prob"), r.get("margin")])
             + ([r.get("gold")] if gold else []) + [r.get(k) for k in kept] for r in rows]
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>" for row in cells)
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<h2>{html.escape(title)}</h2><table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return "" if value is None else str(value)


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem auto;max-width:1100px;color:#222;padding:0 1rem}
h1{font-size:1.5rem;margin-bottom:.2rem} h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
.figures{display:flex;flex-wrap:wrap;gap:1.5rem;align-items:flex-start} .figures svg{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:.9rem;margin:.5rem 0} td,th{border:1px solid #ddd;padding:.25rem .5rem;text-align:left}
th{background:#f4f4f4} .kpi{display:flex;gap:2rem;flex-wrap:wrap;margin:1rem 0}
.kpi div{background:#f6f8fa;border-radius:6px;padding:.6rem 1rem} .kpi b{display:block;font-size:1.4rem}
.muted{color:#666;font-size:.9rem}
"""


def build_report(output: str, compare_with: str | None = None, top: int = 15, fit: str | None = None,
                 earlier: Sequence[str] = ()) -> str:
    """The HTML page for one output of `run` (and its diff with another; `fit`: the figures of the
    `prefixcache fit` whose head answered it; `earlier`: earlier runs' outputs, oldest first, the
    first the reference: the answers over the runs)."""
    page = _build(output, compare_with, top)
    # the head's figures and the runs over time first, under the title and summary line
    summary = page.index("</p>", page.index("<p class=muted>")) + len("</p>")
    first = (_fit_section(_pyplot(), fit) if fit is not None else "") + (
        _history_section(_pyplot(), [*earlier, output]) if earlier else "")
    return page[:summary] + first + page[summary:]


def _history_section(plt: Any, runs: Sequence[str]) -> str:
    """The runs in order, each against the first: its answers' shares and median confidence, the
    drift verdict, its estimated accuracy and its items unlike a head's fitted rows."""
    from .drift import ALPHA, history

    rows = history(runs)
    names = [Path(r["run"]).name for r in rows]
    shares: dict[str, float] = {}
    for r in rows:
        for k, v in r["shares"].items():
            shares[k] = shares.get(k, 0.0) + v
    top = sorted(shares, key=lambda k: -shares[k])[:8]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
    for k in top:
        axes[0].plot(range(len(rows)), [r["shares"].get(k, 0.0) for r in rows], marker="o", label=k)
    axes[0].set_title(f"answer shares ({rows[0]['question']})")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for key, label in (("confidence", "median confidence"), ("estimated_accuracy", "estimated accuracy"),
                       ("beyond", "unlike the fitted rows")):
        values = [r[key] for r in rows]
        if any(v is not None for v in values):
            axes[1].plot(range(len(rows)), [float("nan") if v is None else v for v in values], marker="o", label=label)
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=7)
    table = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{r['items']}</td>"
        f"<td>{'reference' if i == 0 else ('DRIFT' if r['alarm'] else 'no drift')}</td>"
        f"<td>{_figure(r['least_p'], '.2g')}</td>"
        f"<td>{_figure(r['estimated_accuracy'])}</td><td>{_figure(r['beyond'])}</td></tr>"
        for i, (n, r) in enumerate(zip(names, rows, strict=True)))
    return (f"<h2>the runs over time</h2><p class=muted>each run against the first (prefixcache drift, alpha "
            f"{ALPHA})</p><div class=figures>{_svg(fig)}</div><table><tr><th>run</th><th>items</th><th>verdict</th>"
            f"<th>least p</th><th>estimated accuracy</th><th>unlike the fitted rows</th></tr>{table}</table>")


def _figure(value: float | None, how: str = ".3f") -> str:
    return "" if value is None else format(value, how)


def _build(output: str, compare_with: str | None, top: int) -> str:
    plt = _pyplot()
    records = read_records(output, strict=True).records
    if not records:
        raise InputError(f"{output}: holds no records")
    scored = [r for r in records if not is_error(r)]
    info = fingerprint_of(output)
    gold = any("gold" in r for r in scored)
    labels = list(scored[0]["probs"]) if scored and isinstance(scored[0].get("probs"), dict) else None
    parts = [f"<h1>prefixcache report: {html.escape(Path(output).name)}</h1>",
             f"<p class=muted>{html.escape(_summary_line(records, info))}</p>"]
    if any("labels" in r for r in scored):
        return _tag_page(output, records, scored, parts, gold, compare_with, top)
    qids = question_ids(records)
    if qids:
        return _questions_page(plt, output, records, parts, qids, compare_with, top)
    parts += _label_sections(plt, records, scored, gold, labels, top)
    return _page(output, records, parts, compare_with, top)


def _questions_page(plt: Any, output: str, records: Sequence[Record], parts: list[str], qids: Sequence[str],
                    compare_with: str | None, top: int) -> str:
    """A typed-questions output: each question's answers as a label task's (record.question_view)."""
    before = read_records(compare_with, strict=True).records if compare_with else None
    for qid in qids:
        views = [question_view(r, qid) for r in records]
        scored = [v for v in views if not is_error(v)]
        kind = next((r["answers"][qid]["type"] for r in records if not is_error(r)), "")
        parts.append(f"<h2 class=question>question {html.escape(qid)} <span class=muted>({html.escape(kind)})</span></h2>")
        parts += _label_sections(plt, views, scored, any("gold" in v for v in scored), list(scored[0]["probs"]), top)
        if before is not None and compare_with:
            parts.append(_compare_section(compare([question_view(r, qid) for r in before], views), compare_with, top))
    return _page(output, records, parts, None, top)


def _label_sections(plt: Any, records: Sequence[Record], scored: Sequence[Record], gold: bool,
                    labels: list[str] | None, top: int) -> list[str]:
    """The evaluation, figures and tables of a label task's records."""
    parts = []
    figures = [_distributions(plt, scored)] if scored else []
    if gold:
        ev = evaluate(labels, records)
        kpis = [("accuracy", f"{ev.accuracy:.3f}"), ("coverage", f"{ev.coverage:.3f}"), ("items", str(ev.n)),
                ("ECE", f"{ev.ece:.3f}")] + ([("macro-F1", f"{ev.macro_f1:.3f}")] if labels else [])
        parts.append("<div class=kpi>" + "".join(f"<div>{k}<b>{v}</b></div>" for k, v in kpis) + "</div>")
        figures = ([_confusion(plt, ev), _per_label(plt, ev)] if labels else []) + [_reliability(plt, ev)] + figures
    parts.append("<h2>figures</h2><div class=figures>" + "".join(figures) + "</div>")
    if gold:
        wrong = sorted((r for r in scored if not r.get("correct")), key=lambda r: -(r.get("prob") or 0))
        parts.append(_table("wrong with the highest confidence", wrong[:top], gold))
    parts.append(_table("closest calls (smallest margin)", sorted(scored, key=lambda r: r["margin"])[:top], gold))
    parts.append(_failed_table(records, top))
    return parts


def _page(output: str, records: Sequence[Record], parts: list[str], compare_with: str | None, top: int) -> str:
    if compare_with:
        before = read_records(compare_with, strict=True).records
        parts.append(_compare_section(compare(before, records), compare_with, top))
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>prefixcache report: {html.escape(Path(output).name)}</title><style>{CSS}</style></head><body>"
            + "".join(parts) + "</body></html>\n")


def _tag_page(output: str, records: Sequence[Record], scored: Sequence[Record], parts: list[str], gold: bool,
              compare_with: str | None, top: int) -> str:
    """The page for a multi-label output: the figures per label, the per-label table, the items
    whose label set is wrong."""
    ev = evaluate(list(scored[0]["probs"]), records, tags=True) if gold else None
    if ev is not None:
        micro = ev.micro()
        kpis = [("exact-set accuracy", f"{ev.accuracy:.3f}"), ("Hamming loss", f"{ev.hamming_loss:.3f}"),
                ("micro-F1", f"{micro[2]:.3f}"), ("macro-F1", f"{ev.macro_f1:.3f}"), ("items", str(ev.n)),
                ("ECE", f"{ev.ece:.3f}")]
        parts.append("<div class=kpi>" + "".join(f"<div>{k}<b>{v}</b></div>" for k, v in kpis) + "</div>")
    parts.append("<h2>figures</h2><div class=figures>" + "".join(_tag_figures(_pyplot(), ev, scored)) + "</div>")
    if ev is not None:
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v['precision']:.3f}</td><td>{v['recall']:.3f}</td>"
                       f"<td>{v['f1']:.3f}</td><td>{v['support']}</td></tr>" for k, v in ev.per_label().items())
        parts.append("<h2>per label</h2><table><thead><tr><th>label</th><th>precision</th><th>recall</th><th>F1</th>"
                     f"<th>support</th></tr></thead><tbody>{rows}</tbody></table>")
        parts.append(_table("label set wrong", [r for r in scored if not r.get("correct")][:top], gold))
    parts.append(_failed_table(records, top))
    return _page(output, records, parts, compare_with, top)


def _summary_line(records: Sequence[Record], info: dict[str, Any]) -> str:
    scored = [r for r in records if not is_error(r)]
    ms = sum(r.get("ms") or 0 for r in scored) / max(len(scored), 1)
    parts = [f"{len(records)} items", f"{len(records) - len(scored)} failed" if len(scored) < len(records) else "",
             f"model {_model_name(info['model'])}" if info.get("model") else "",
             f"{info.get('device', '')} {info.get('dtype', '')}".strip(), f"{ms:.1f} ms/item",
             f"normalize {scored[0]['normalize']}" if scored and 'normalize' in scored[0] else "",
             _pruned_note(scored)]
    return " · ".join(p for p in parts if p)


def _pruned_note(scored: Sequence[Record]) -> str:
    n = sum(bool(r.get("pruned")) for r in scored)
    return (f"{n} items with labels pruned: their label is exact; their probabilities within 1e-4 of scoring "
            f"every label with --prune exact, lower bounds for the labels scored to the end with --prune on") if n else ""


def _model_name(identity: str) -> str:
    """The model as a reader names it, from the fingerprint's identity ("gguf:<file>:<digest>",
    "hub:<id>@<revision>", "dir:<path>:<digest>"): the file, hub id or folder."""
    kind, _, rest = identity.partition(":")
    if kind != "hub" and ":" in rest:
        rest = rest.rsplit(":", 1)[0]
    return rest or identity


def _failed_table(records: Sequence[Record], top: int) -> str:
    failed = [r for r in records if is_error(r)]
    if not failed:
        return ""
    rows = "".join(f"<tr><td>{html.escape(str(r['id']))}</td><td>{html.escape(str(r['error']))}</td></tr>"
                   for r in failed[:top * 4])
    more = f"<p class=muted>and {len(failed) - top * 4} more</p>" if len(failed) > top * 4 else ""
    return (f"<h2>items that could not be scored ({len(failed)})</h2><table><thead><tr><th>id</th><th>why</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>{more}")


def _compare_section(cmp: Comparison, before: str, top: int) -> str:
    """`--compare BEFORE`: what changed from that run (A) to this one (B), as `diff BEFORE THIS` says."""
    head = (f"<h2>compared with {html.escape(Path(before).name)}: before → this run</h2><p>{cmp.both} items in both · "
            f"{len(cmp.changed)} changed ({cmp.change_rate:.1%})")
    if cmp.gold:
        head += (f" · accuracy {cmp.accuracy_a:.3f} → {cmp.accuracy_b:.3f} · fixed {len(cmp.fixed)} · broken "
                 f"{len(cmp.broken)} · McNemar exact p = {cmp.p_value:.3g}")
    rows = "".join(f"<tr><td>{html.escape(x)}</td><td>{html.escape(y)}</td><td>{n}</td></tr>"
                   for (x, y), n in cmp.flips.most_common(top))
    flips = (f"<table><thead><tr><th>before</th><th>this run</th><th>items</th></tr></thead><tbody>{rows}</tbody>"
             f"</table>")
    ids = "".join(f"<p><b>{what}</b> ({len(which)}): {html.escape(', '.join(which[:top * 4]))}"
                  f"{f' … and {len(which) - top * 4} more' if len(which) > top * 4 else ''}</p>"
                  for what, which in (("fixed", cmp.fixed), ("broken", cmp.broken)) if cmp.gold and which)
    return head + "</p>" + (flips if rows else "") + ids


def _fit_section(plt: Any, path: str) -> str:
    """What `fit` found (its JSON figures): per question the head beside the prompt alone on the
    same held-out folds, and the learning curve."""
    try:
        found = json.loads(Path(path).read_text(encoding="utf-8"))
        questions = found["questions"]
        rows = [(q["question"], name, q[key]["accuracy"], q[key]["macro_f1"], q[key]["ece"], q["verdict"], q)
                for q in questions for name, key in (("head", "head"), ("prompt alone", "prompt"),
                                                     ("TF-IDF + LR", "tfidf_baseline")) if q.get(key)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--fit {path}: not the figures of prefixcache fit (its .fit.json): {exc}") from None
    head = (f"<h2>the head (prefixcache fit)</h2><p class=muted>{html.escape(str(found.get('items')))} labelled items, "
            f"{html.escape(str(found.get('folds')))}-fold cross-validation, held out; 95% bootstrap intervals</p>")
    cells = "".join(f"<tr><td>{html.escape(q)}</td><td>{name}</td><td>{_interval(a)}</td><td>{_interval(f)}</td>"
                    f"<td>{e:.3f}</td><td>{VERDICTS.get(v, html.escape(str(v))) if name == 'head' else ''}</td></tr>"
                    for q, name, a, f, e, v, _ in rows)
    table = ("<table><thead><tr><th>question</th><th>readout</th><th>accuracy</th><th>macro-F1</th><th>ECE</th>"
             f"<th>verdict</th></tr></thead><tbody>{cells}</tbody></table>")
    figures = [f for f in (_learning_figure(plt, questions), _coverage_figure(plt, questions)) if f]
    return head + table + (f"<div class=figures>{''.join(figures)}</div>" if figures else "")


def _learning_figure(plt: Any, questions: list) -> str:
    """Held-out accuracy by labelled items a class, each question's prompt alone dotted beside it."""
    curves = [q for q in questions if q.get("learning_curve")]
    if not curves:
        return ""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for q in curves:
        xs = [c["per_class"] for c in q["learning_curve"]]
        ax.plot(xs, [c["accuracy"] for c in q["learning_curve"]], marker="o", label=f"{q['question']}: head")
        ax.axhline(q["prompt"]["accuracy"]["value"], linestyle=":", linewidth=1, color=ax.lines[-1].get_color(),
                   label=f"{q['question']}: prompt alone")
    ax.set_xscale("log", base=2)
    ticks = sorted({c["per_class"] for q in curves for c in q["learning_curve"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])  # plain numbers (the report's text is never TeX)
    ax.minorticks_off()
    ax.set_xlabel("labelled items a class")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("learning curve")
    ax.legend(fontsize=7)
    return _svg(fig)


def _coverage_figure(plt: Any, questions: list) -> str:
    """Accuracy of the answered items by the share answered (the head's most confident first), its
    lower bound shaded, and the cut fit chose marked."""
    tables = [q for q in questions if q.get("risk_coverage")]
    if not tables:
        return ""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for q in tables:
        rows = q["risk_coverage"]
        xs = [r["coverage"] for r in rows]
        ax.plot(xs, [r["accuracy"] for r in rows], marker=".", label=f"{q['question']}: accuracy answered")
        ax.fill_between(xs, [r["low"] for r in rows], [r["accuracy"] for r in rows], alpha=0.2,
                        color=ax.lines[-1].get_color(), linewidth=0)
        chosen = (q.get("cut") or {}).get("chosen")
        if chosen:
            ax.axvline(chosen["coverage"], linestyle="--", linewidth=1, color=ax.lines[-1].get_color(),
                       label=f"{q['question']}: cut {chosen['cut']:.2f}")
        target = (q.get("cut") or {}).get("target_accuracy")
        if target:
            ax.axhline(target, linestyle=":", linewidth=1, color="gray", label=f"target {target:g}")
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("share of items answered (most confident first)")
    ax.set_ylabel("held-out accuracy of those")
    ax.set_title("risk and coverage (shaded: down to the lower bound)")
    ax.legend(fontsize=7)
    return _svg(fig)


VERDICTS = {"head": "the head is better beyond noise", "prompt": "the prompt alone is better beyond noise",
            "tie": "not enough labels to tell"}


def _interval(figure: Any) -> str:
    return f"{figure['value']:.3f} [{figure['low']:.3f}, {figure['high']:.3f}]"


def write_report(output: str, target: str, compare_with: str | None = None, overwrite: bool = False,
                 fit: str | None = None, earlier: Sequence[str] = ()) -> None:
    """Write the page to `target`; an existing file is refused unless `overwrite`, and so is
    `target` naming an output it reads (whatever `overwrite`)."""
    check_distinct({"-o": target}, {"the output": output, "--compare": compare_with, "--fit": fit,
                                    **{f"--earlier {run}": run for run in earlier}},
                   outputs=("the output", "--compare", *(f"--earlier {run}" for run in earlier)))
    safefile.check_target(target, "-o")
    if Path(target).exists() and not overwrite:
        raise InputError(f"{target}: already exists; give --overwrite to replace it, or another -o")
    page = build_report(output, compare_with, fit=fit, earlier=earlier)
    safefile.replace(target, page, what="the report")
