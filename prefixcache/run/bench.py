"""`prefixcache bench`: one model load, several ways of getting the same scores, timed.

Modes, each timed after a warm-up on the same items:
- naive: the whole prompt re-encoded for every item, all labels in that one pass (one full
  forward per item);
- naive per label: one full forward per (item, label), as lm-evaluation-harness does;
- cached, one item at a time: the prefix prefilled once, batches of one;
- run: the `run` pipeline as shipped (cached, batched).

Efficiency is the fraction of this machine's measured matmul peak reached on the work no method
can avoid: the item's own tokens and the label tokens after each label's first (the first is
scored from the item's last logits), through every linear layer, plus the lm_head rows scored.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import UsageError
from ..scoring.exact import CheckedScorer
from ..data.items import Item
from ..data.records import Record
from ..task.questions import Answers, answer_word, label_kind
from ..task.spec import TaskSpec
from ..model.rows import Row, trie
from .pipeline import classify
from ..scoring.build import build_scorer
from ..scoring.options import ScoringOptions
from ..scoring.scorer import Scorer
from ..model.engines import default_backend
from ..model.precision import low_names
from ..model.protocol import timed as timed_engine
from ..model.store import PrefixStore
from ..scoring.prepare import Batching, Prepared, Task


@dataclass
class ModeResult:
    mode: str
    items: int
    ms_per_item: float
    items_per_second: float
    peak_rss_mb: float | None
    efficiency: float | None = None
    speedup: float | None = None
    estimated: bool = False  # not timed: one forward's time times the forwards (too slow to run unasked)
    labels: list[str | None] = field(default_factory=list, repr=False)


@dataclass
class BenchReport:
    device: str
    dtype: str
    threads: int
    peak_gflops: float
    load_seconds: float
    prefill_ms: float
    prefix_tokens: int
    item_tokens: float  # per item, own tokens
    candidate_tokens: float  # label tokens fed after the item (trie nodes), per item
    unavoidable_gflop: float  # per item
    same_labels: bool
    items_compared: int  # the items every mode scored (the naive modes' --limit)
    items_differing: int  # of those, how many got a label in some mode other than the naive one's
    option_cost_ratio: float  # scoring every label vs scoring the item alone, same batches, timed
    option_cost_floor: float  # the same ratio of unavoidable work (what no method can go below)
    store_load_ms: float  # loading the prefilled prefix from the prefix store (verified)
    store_prefill_ms: float  # computing it, timed in the same process
    modes: list[ModeResult]
    pruning: PruningResult | None = None  # label tasks: pruned against full scoring (see `time_pruning`)
    head_alone: ModeResult | None = None  # a fitted head of the state alone: the run pipeline scoring no option
    first_token: ModeResult | None = None  # the engine's cheapest ranking (first token of each label), where it has one
    first_token_differing: int = 0  # items the first-token ranking labels otherwise than the run pipeline
    questions: QuestionsResult | None = None  # typed questions: together against one at a time (`time_questions`)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for m in data["modes"] + [data[k] for k in ("head_alone", "first_token") if data[k]]:
            m.pop("labels")
        return data


PEAK_SECONDS = 1.0  # spent measuring the matmul peak


class _PeakRSS:
    """Samples the process's resident memory while a mode runs (Linux; None elsewhere)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> "_PeakRSS":
        if not os.path.exists("/proc/self/statm"):
            self.peak = -1
            return self
        self.peak = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.peak >= 0:
            self._thread.join()
            self.peak = max(self.peak, self._rss())

    @property
    def mb(self) -> float | None:
        return None if self.peak < 0 else self.peak / 2**20


Step = Callable[[str], None]  # told what is being measured now, for a progress line


def _quiet(text: str) -> None:
    pass


WARM_ITEMS = 4  # items the pipeline's warm-up scores


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _timed(name: str, n: int, fn: Callable[[], Sequence[str | None]], engine: Any, step: Step = _quiet,
           about: float | None = None) -> ModeResult:
    step(f"timing {name} on {n} items" + (f" (about {_duration(about)})" if about is not None and about >= 10 else ""))
    engine.synchronize()
    with _PeakRSS() as rss:
        start = time.perf_counter()
        labels = fn()
        engine.synchronize()
        elapsed = time.perf_counter() - start
    return ModeResult(name, n, 1000 * elapsed / n, n / elapsed, rss.mb, labels=list(labels))


def prediction(answers: Answers, spec: TaskSpec) -> str | None:
    """What an item's answers predict, as text: a pack's answers each in a word, or a label
    spec's one question's prediction (the label, None when it abstained; the labels on)."""
    if spec.questions:
        return _said(answers.answers())
    q, decision = answers.questions[0], answers.decisions[0]
    return label_kind(spec).prediction(q, decision)


def record_prediction(record: Record) -> str | None:
    """`prediction`, read from a record."""
    if "answers" in record:
        return _said(record["answers"])
    return " | ".join(record["labels"]) if "labels" in record else record.get("label")


def _said(answers: Mapping[str, Mapping[str, Any]]) -> str:
    return "; ".join(f"{qid}={answer_word(a)}" for qid, a in answers.items())


@dataclass
class QuestionsResult:
    """Typed questions: every question in one pass per batch against each question in a pass of
    its own (what one-question runs of the same prompt cost), on the same batches of the same
    items, model time only."""

    items: int
    questions: int
    item_tokens: float  # per item, its own tokens
    together_ms: float  # per item
    alone_ms: dict[str, float]  # per question, per item
    max_difference: float  # the largest |log-prob| difference of any answer between the two ways

    @property
    def alone_total_ms(self) -> float:
        return sum(self.alone_ms.values())

    @property
    def ratio(self) -> float:
        return self.alone_total_ms / self.together_ms


def time_questions(scorer: Scorer, items: Sequence[Item], batching: Batching, step: Step = _quiet) -> QuestionsResult:
    """Score the items' questions together, then each question alone, each timed after a warm-up."""
    task, engine, prefix = scorer.task, scorer.engine, scorer.prefix
    groups = [[p for p in batch if isinstance(p, Prepared)] for batch in task.batches(items, batching, scorer.context)]
    spans = task.builder.spans

    def rows(group: Sequence[Prepared], span: tuple[int, int] | None) -> list[Row]:
        if span is None:
            return [p.row for p in group]
        a, b = span
        return [Row(p.enc.ids, p.enc.prefix_len, list(p.candidates.values())[a:b], p.skips[a:b]) for p in group]

    def timed(span: tuple[int, int] | None) -> tuple[float, list[list[float]]]:
        engine.score(prefix, rows(groups[0][:1], span))  # warm-up
        start, out = time.perf_counter(), []
        for group in groups:
            out += engine.score(prefix, rows(group, span))
        return 1000 * (time.perf_counter() - start) / len(items), out

    n = len(task.spec.questions)
    step(f"timing {n} questions asked together, then each alone, on {len(items)} items")
    together_ms, together = timed(None)
    alone_ms, diff = {}, 0.0
    for q, span in zip(task.spec.questions, spans):
        ms, scores = timed(span)
        alone_ms[q.id] = ms
        diff = max([diff] + [abs(x - y) for whole, part in zip(together, scores) for x, y in zip(whole[span[0]:span[1]], part)])
    own = sum(p.own_tokens for g in groups for p in g) / len(items)
    return QuestionsResult(len(items), n, own, together_ms, alone_ms, diff)


@dataclass
class PruningRace:
    """One pruned mode (`--prune on` or `exact`) against scoring every candidate, on the same items."""

    ms: float  # per item
    label_tokens: float  # candidate tokens run through the model, per item
    left: float  # candidates left at their bound, per item
    items_differing: int  # items whose answer differs from full scoring's
    prob_gap: float  # the largest difference of a reported probability from full scoring's


@dataclass
class PruningResult:
    """The run pipeline with every label scored to the end, and with each pruned mode, on the
    same items: time, label tokens run through the model, and whether every label agrees."""

    items: int
    full_ms: float  # per item
    full_label_tokens: float  # per item
    races: dict[str, PruningRace]  # by mode: "on", "exact"
    labels: int  # the task's labels
    what: str = "labels"  # what is pruned: "labels", or typed questions' "options"

    @property
    def same_labels(self) -> bool:
        return all(r.items_differing == 0 for r in self.races.values())


def time_pruning(scorer: Scorer, items: Sequence[Item], batching: Batching, step: Step = _quiet) -> PruningResult:
    """Time the pipeline every way on `items` (each after a warm-up), one after the other."""
    runs = {mode: _time_mode(scorer, items, batching, mode, step) for mode in ("off", "on", "exact")}
    scorer.prune("off")
    full_ms, full_tokens, full = runs.pop("off")
    races = {mode: PruningRace(ms, tokens, sum(_bounded(r.get("pruned")) for r in records) / len(items),
                               sum(record_prediction(a) != record_prediction(b) for a, b in zip(full, records)),
                               max((_gap(a, b) for a, b in zip(full, records)), default=0.0))
             for mode, (ms, tokens, records) in runs.items()}
    spec = scorer.task.spec
    raced = sum(len(q.options) for q in spec.questions if q.kind.races and q.groups.plain)
    return PruningResult(len(items), full_ms, full_tokens, races, raced if spec.questions else len(spec.labels),
                         "options" if spec.questions else "labels")


def _time_mode(scorer: Scorer, items: Sequence[Item], batching: Batching, mode: str,
               step: Step) -> tuple[float, float, list[dict]]:
    """ms/item, candidate tokens/item and the records of the pipeline with `--prune mode`."""
    scorer.prune(mode)
    batching = dataclasses.replace(batching, pruned=mode != "off")  # as `run` forms its batches
    warm = items[: min(batching.size, WARM_ITEMS)]  # a few items: their time gives the estimate
    scorer.clear()  # scores kept from an earlier mode would make the warm-up (and the estimate) free
    about = _seconds(lambda: list(classify(scorer, warm, batching))) / len(warm) * len(items)  # warm-up
    scorer.clear()
    step(f"timing --prune {mode} on {len(items)} items" + (f" (about {_duration(about)})" if about >= 10 else ""))
    fed, start = timed_engine(scorer.engine).label_tokens, time.perf_counter()
    records = list(classify(scorer, items, batching))
    ms = 1000 * (time.perf_counter() - start) / len(items)
    return ms, (timed_engine(scorer.engine).label_tokens - fed) / len(items), records


def _gap(full: Mapping, pruned: Mapping) -> float:
    """The largest difference between two records' reported probabilities (labels, or every
    typed question's options)."""
    pairs = [(full.get("probs"), pruned.get("probs"))]
    theirs = pruned.get("answers") or {}
    pairs += [(a.get("probabilities"), theirs.get(qid, {}).get("probabilities"))
              for qid, a in (full.get("answers") or {}).items()]
    gap = 0.0
    for a, b in pairs:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            gap = max([gap] + [abs(a[k] - b[k]) for k in a if k in b])
    return gap


def _bounded(pruned: Sequence[str] | Mapping[str, Sequence[str]] | None) -> int:
    """How many labels (or options, by question) a record says are left at their bound."""
    if isinstance(pruned, Mapping):
        return sum(len(options) for options in pruned.values())
    return len(pruned or ())


def _option_cost_ratio(scorer: Scorer, items: Sequence[Item], batching: Batching) -> float:
    """Time of scoring every candidate over time of scoring one one-token candidate (the item
    alone: its own tokens and one row of logits), on the same batches of the same items."""
    engine, prefix = scorer.engine, scorer.prefix
    groups = list(scorer.task.batches(items, batching, scorer.context))

    def timed(alone: bool) -> float:
        start = time.perf_counter()
        for group in groups:
            rows = [Row(p.enc.ids, p.enc.prefix_len,
                        [next(iter(p.candidates.values()))[-1:]] if alone else list(p.candidates.values()))
                    for p in group if isinstance(p, Prepared)]
            engine.score(prefix, rows)
        return time.perf_counter() - start

    timed(False), timed(True)  # warm-up
    return timed(False) / timed(True)


def _store_timings(scorer: Scorer) -> tuple[float, float]:
    """(prefill ms, prefix-store load ms) for this spec's prefix, best of three each, through a
    throwaway store."""
    engine, ids = scorer.engine, scorer.task.builder.prefix_ids
    prefill = min(engine.prefill(ids).prefill_ms for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        store = PrefixStore(Path(tmp))
        store.save("bench", engine.prefill(ids), "bench", engine)
        load = min(store.load("bench", engine).prefill_ms for _ in range(3))
    return prefill, load


def _unavoidable_work(engine: Any, prepared: Sequence[Prepared]) -> tuple[float, float, float, float]:
    """Per item: own tokens, label tokens fed after the item (trie nodes), GFLOP of the linear
    layers on them plus the lm_head rows scored, and the GFLOP of the item alone (its tokens and
    one row of logits: one one-token candidate). A llama.cpp engine's layers are counted from its
    file (every weight but the embeddings' in the body, the output layer the embeddings' size)."""
    body, head = engine.linear_params()
    nodes = sum(len(trie(list(p.candidates.values()))) for p in prepared) / len(prepared)
    own = sum(p.own_tokens for p in prepared) / len(prepared)
    gflop = (2 * body * (own + nodes) + 2 * head * (1 + nodes)) / 1e9
    return own, nodes, gflop, (2 * body * own + 2 * head) / 1e9


NAIVE_SECONDS = 60.0  # longer than this, the per-label naive mode is estimated unless asked for


class _Modes:
    """The four ways of getting the same scores, each a function of the items it runs on that
    returns what each item is predicted."""

    def __init__(self, scorer: Scorer, items: Sequence[Item], prepared: Sequence[Prepared], naive_limit: int,
                 batching: Batching):
        self.scorer, self.items, self.prepared, self.batching = scorer, items, prepared, batching
        self.few = prepared[:naive_limit]
        self.rewinds = "rewound" in timed_engine(scorer.engine).naive_ways  # the engine's own one-prompt path, timed too

    def _pick(self, prep: Prepared, scores: list[float]) -> str | None:
        """The decision `run` would make from these candidate scores (forms combined,
        normalisation, calibration, threshold)."""
        return prediction(self.scorer.decide(prep, prep.groups.combine(scores)), self.scorer.task.spec)

    def naive(self, rows: Sequence[Prepared] | None = None) -> list[str | None]:
        return [self._pick(p, self._naive(p, "item")) for p in (self.few if rows is None else rows)]

    def naive_per_label(self, rows: Sequence[Prepared] | None = None) -> list[str | None]:
        return [self._pick(p, self._naive(p, "candidate")) for p in (self.few if rows is None else rows)]

    def rewound(self, rows: Sequence[Prepared] | None = None) -> list[str | None]:
        """The engine's own one-prompt-at-a-time path, rewound to what each prompt shares with the last."""
        return [self._pick(p, self._naive(p, "rewound")) for p in (self.prepared if rows is None else rows)]

    def first_token(self, rows: Sequence[Prepared] | None = None) -> list[str | None]:
        """The engine's cheapest ranking: each label by its first token alone, one prompt at a time."""
        return [self._pick(p, self._naive(p, "first")) for p in (self.prepared if rows is None else rows)]

    def _naive(self, prep: Prepared, way: str) -> list[float]:
        return timed_engine(self.scorer.engine).naive(Row(prep.enc.ids, 0, _cands(prep), prep.skips), way)

    def cached_single(self, rows: Sequence[Prepared] | None = None) -> list[str | None]:
        engine, prefix = self.scorer.engine, self.scorer.prefix
        return [self._pick(p, engine.score(prefix, [p.row])[0]) for p in (self.prepared if rows is None else rows)]

    def pipeline(self, items: Sequence[Item] | None = None) -> list[str | None]:
        self.scorer.clear()  # the warm-up's scores must not be reused
        return [record_prediction(r) for r in classify(self.scorer, self.items if items is None else items,
                                                       self.batching)]

    def warm_up(self) -> tuple[list[float], float]:
        """Each mode's estimated seconds on its items, from a warm-up (first calls pay for
        allocations and kernel set-up) on one item, one label of one item for the per-label mode
        (each label is a forward of its own), and a few items of the pipeline; and the seconds of
        one item of the per-label mode."""
        first, warm = self.few[0], self.items[:min(self.batching.size, WARM_ITEMS)]
        one_label = dataclasses.replace(first, candidates=dict(list(first.candidates.items())[:1]),
                                        skips=first.skips[:1])
        per_label = _seconds(lambda: self._naive(one_label, "candidate")) * len(_cands(first))
        seconds = [_seconds(lambda: self.naive(self.few[:1])), per_label, _seconds(lambda: self.cached_single(
            self.prepared[:1])), _seconds(lambda: self.pipeline(warm)) / max(len(warm), 1)]
        counts = (len(self.few), len(self.few), len(self.prepared), len(self.items))
        return [s * n for s, n in zip(seconds, counts)], per_label


def _cands(prep: Prepared) -> list[tuple[int, ...]]:
    return list(prep.candidates.values())


def _timed_modes(scorer: Scorer, items: Sequence[Item], prepared: Sequence[Prepared], naive_limit: int,
                 batching: Batching, step: Step = _quiet, estimate_slow: bool = False) -> list[ModeResult]:
    """The four ways of getting the same scores, each timed after a warm-up on the same items
    (`estimate_slow`: the per-label naive mode estimated when it would take over NAIVE_SECONDS)."""
    modes, engine = _Modes(scorer, items, prepared, naive_limit, batching), scorer.engine
    step(f"warming up each mode on one item (with {len(scorer.task.spec.labels) or 'its'} labels)")
    each, per_label = modes.warm_up()
    per_label_name = "naive: full forward per item and label"
    estimated = estimate_slow and each[1] > NAIVE_SECONDS  # minutes per item: said from its first forward, not run
    step(f"timing every mode: about {_duration(sum(each) - (each[1] if estimated else 0))} from the warm-up "
         f"(first calls are slower, so likely less)")
    first_mode = _timed("naive: full re-encode per item", len(modes.few), modes.naive, engine, step, each[0])
    if estimated:
        step(f"not timing {per_label_name}: about {_duration(each[1])}; its time is estimated from one forward "
             f"(give --limit to time it)")
        slow = ModeResult(per_label_name, len(modes.few), 1000 * per_label, 1 / per_label, None, estimated=True)
    else:
        slow = _timed(per_label_name, len(modes.few), modes.naive_per_label, engine, step, each[1])
    pipeline_name = f"run pipeline (<= {batching.size} items, ~{batching.tokens} tokens a batch)"
    rewound = [_timed(f"{engine.name} one prompt at a time, rewound to the shared start", len(prepared),
                      modes.rewound, engine, step, each[2])] if modes.rewinds else []
    return [
        first_mode,
        slow,
        *rewound,
        _timed("cached, one item at a time", len(prepared), modes.cached_single, engine, step, each[2]),
        _timed(pipeline_name, len(items), modes.pipeline, engine, step, each[3]),
    ]


def run_bench(scorer: Scorer, items: Sequence[Item], naive_limit: int, batching: Batching = Batching(),
              step: Step = _quiet, estimate_slow: bool = False, head: Scorer | None = None) -> BenchReport:
    """Time every mode on `items` (the naive ones on the first `naive_limit`) and measure the
    unavoidable work, the cost of scoring every label, and the prefix store. `step` is told what
    is measured as it starts; `estimate_slow`: see `_timed_modes`. `head`: the fitted spec's
    scorer on the same engine; when its head answers alone, its pipeline is timed too."""
    engine, prefix, task = scorer.engine, scorer.prefix, scorer.task
    prepared = [task.prepare(item, scorer.context) for item in items]
    modes = _timed_modes(scorer, items, prepared, naive_limit, batching, step, estimate_slow)
    head_mode = _time_head_alone(head, items, batching, step) if head is not None and head.head_only else None
    if head_mode is not None:
        head_mode.speedup = modes[0].ms_per_item / head_mode.ms_per_item
    first = _time_first_token(scorer, items, prepared, batching, step)
    if first is not None:
        first.speedup = modes[0].ms_per_item / first.ms_per_item
    # Option cost: the same pipeline scoring one one-token candidate instead of every label.
    about = 2 * modes[-1].ms_per_item * len(items) / 1000  # every label twice (warm-up, timed); the item alone is less
    step("timing every label against the item alone" + (f" (about {_duration(about)})" if about >= 10 else ""))
    option_ratio = _option_cost_ratio(scorer, items, batching)
    # an engine that keeps no item between passes scores every label whatever --prune says: nothing to time
    pruning = time_pruning(scorer, items, batching, step) if task.spec.prunes("on") and engine.branches else None
    questions = time_questions(scorer, items, batching, step) if task.spec.questions else None
    step("timing the prefix store")
    prefill_ms, load_ms = _store_timings(scorer)

    own, nodes, gflop, alone = _unavoidable_work(engine, prepared)
    engine = timed_engine(engine)
    step("measuring this machine's matrix-product peak at the engine's precision, where it has one")
    peak = engine.peak_gflops(PEAK_SECONDS) or 0.0  # none: quantised kernels, no float matmul peak to compare with
    for m in modes:
        m.speedup = modes[0].ms_per_item / m.ms_per_item
        m.efficiency = gflop / (m.ms_per_item / 1000) / peak if peak else None
    n = min(naive_limit, len(prepared))
    differing = sum(any(m.labels[i] != modes[0].labels[i] for m in modes if not m.estimated) for i in range(n))
    return BenchReport(
        device=str(engine.device) if engine.name == default_backend().name else f"{engine.name} {engine.device}",
        dtype=engine.precision, threads=engine.threads,
        peak_gflops=peak, load_seconds=task.load_seconds + scorer.load_seconds, prefill_ms=prefix.prefill_ms,
        prefix_tokens=len(prefix.ids), item_tokens=own, candidate_tokens=nodes, unavoidable_gflop=gflop,
        same_labels=differing == 0, items_compared=n, items_differing=differing,
        option_cost_ratio=option_ratio, option_cost_floor=gflop / alone, modes=modes,
        store_load_ms=load_ms, store_prefill_ms=prefill_ms, pruning=pruning, questions=questions, head_alone=head_mode,
        first_token=first, first_token_differing=sum(a != b for a, b in zip(first.labels, modes[-1].labels)) if first
        else 0,
    )


def _time_head_alone(head: Scorer, items: Sequence[Item], batching: Batching, step: Step) -> ModeResult:
    """The run pipeline of a fitted spec whose head answers alone (no option scored), after a warm-up,
    in the batches `run` forms for it (one token an answer)."""
    batching = batching.answering(head.task.spec, True)
    warm = list(items[:min(batching.size, WARM_ITEMS)])
    list(classify(head, warm, batching))
    head.clear()
    return _timed(HEAD_ALONE, len(items), lambda: [record_prediction(r) for r in classify(head, items, batching)],
                  head.engine, step)


HEAD_ALONE = "run pipeline, the fitted head alone (no option scored)"


def _time_first_token(scorer: Scorer, items: Sequence[Item], prepared: Sequence[Prepared], batching: Batching,
                      step: Step) -> ModeResult | None:
    """The engine's cheapest ranking (each label's first token alone, one prompt at a time), timed
    after a warm-up, where the engine offers it and no question's text comes before its options."""
    engine = timed_engine(scorer.engine)
    if "first" not in engine.naive_ways or any(any(p.skips) for p in prepared):
        return None
    modes = _Modes(scorer, items, prepared, 1, batching)
    modes.first_token(prepared[:1])
    return _timed(f"{engine.name} first token of each label only, one prompt at a time (its cheapest)",
                  len(prepared), modes.first_token, engine, step)


@dataclass
class PrecisionReport:
    """`bench --exact`: the run pipeline in float32, in the low precision, and with close calls
    re-scored in float32, on the same items in one process."""

    dtype: str
    items: int
    float32_ms: float
    fast_ms: float
    exact_ms: float
    rescored: int  # items the exact mode scored again in float32
    bound: float  # its final gap bound
    labels_differ_fast: int  # items whose label differs from float32's
    labels_differ_exact: int
    extra_weights_mb: float  # the second copy of the weights

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_precision_bench(fp32: Scorer, fast: Scorer, checked: CheckedScorer, items: Sequence[Item],
                        batching: Batching = Batching(), step: Step = _quiet) -> PrecisionReport:
    def timed(scorer: Scorer, name: str) -> ModeResult:
        list(classify(scorer, items[: batching.size], batching))  # warm-up
        scorer.clear()  # its scores do not carry over (--exact's bound, a property of the task, does)
        labels = lambda: [record_prediction(r) for r in classify(scorer, items, batching)]  # noqa: E731
        return _timed(name, len(items), labels, scorer.engine, step)

    runs = [timed(s, name) for s, name in ((fp32, "float32"), (fast, fast.dtype), (checked, f"{fast.dtype} --exact"))]
    (ms32, want), (ms_fast, fast_labels), (ms_exact, exact_labels) = ((m.ms_per_item, m.labels) for m in runs)
    weights = timed_engine(fp32.engine).weights_bytes / 2**20
    return PrecisionReport(
        dtype=fast.dtype, items=len(items), float32_ms=ms32, fast_ms=ms_fast, exact_ms=ms_exact,
        rescored=checked.rescored, bound=checked.bound or 0.0,
        labels_differ_fast=sum(a != b for a, b in zip(fast_labels, want)),
        labels_differ_exact=sum(a != b for a, b in zip(exact_labels, want)), extra_weights_mb=weights,
    )


def bench_exact(task: Task, items: Sequence[Item], options: ScoringOptions, batching: Batching = Batching(),
                step: Step = _quiet) -> PrecisionReport:
    """Load the float32 and the low-precision models and time the three ways of scoring (each
    prefix prefilled, every label scored: precision is what is compared)."""
    if options.dtype not in low_names():
        raise UsageError("bench --exact compares float32 with a low precision: give --dtype bfloat16 (or int8, float16)")
    step("loading the float32 and the low-precision models")
    plain = options.replace(prune="off", cache_store=False, exact=False)
    fp32, fast = build_scorer(task, plain.replace(dtype="float32")), build_scorer(task, plain)
    # the pair itself, even where `run --exact` would score in float32 alone (no bfloat16 matrix
    # instructions): what it would cost there is what this measures
    checked = CheckedScorer.pair(task, options.cache_dir, options.device, options.dtype)
    checked.calibrate(items)  # as a run would: on the first items, before any is timed
    return run_precision_bench(fp32, fast, checked, items, batching, step)
