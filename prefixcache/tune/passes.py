"""The labelled items scored once per prompt variant, and what every rule decides from those
scores. The torch side of tune: imported once a model is needed.

Each model is loaded once for the variants that use it; each variant's prefix comes from the
prefix store (or is prefilled once and kept there). The items go through the same batches as
`run` forms, so a rule's decisions are those of `run` with that rule written in the spec.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..data.items import Item
from ..scoring.build import build_on, load_engine
from ..scoring.options import ScoringOptions
from ..scoring.prepare import Batching, Prepared, Task, all_prepared
from ..task.decision import Decision
from ..scoring.scorer import Scorer
from .rules import Decided, Rule
from .variants import Variant

log = logging.getLogger(__name__)


@dataclass
class Scored:
    """One variant's pass over the items: what each rule decides, and what the pass cost."""

    decided: dict[Rule, Decided]
    items: int
    seconds: float  # scoring the items (the content-free options of multiple choice apart)
    prefix_tokens: int
    prefix_source: str  # "computed" or "loaded" (from the prefix store)
    unconditional_seconds: float = 0.0  # multiple choice: scoring each item's options content-free (pmi)

    @property
    def ms_per_item(self) -> float:
        return 1000 * self.seconds / self.items if self.items else 0.0


Step = Callable[[str, int, int], None]  # (what, done, total): progress


def score_variants(variants: Sequence[Variant], items: Sequence[Item], rules: Sequence[Rule],
                   options: ScoringOptions, batching: Batching, step: Step = lambda what, done, total: None
                   ) -> list[Scored]:
    """Every variant's `Scored`, in order; each model loaded once, for its variants in a row.
    Every label is scored to the end (the rules compare them all): never pruned, never --exact."""
    options = options.replace(prune="off", exact=False)
    out: dict[int, Scored] = {}
    models: dict[tuple, list[int]] = {}
    for n, variant in enumerate(variants):
        models.setdefault((variant.spec.model, variant.spec.revision, variant.spec.trust_remote_code), []).append(n)
    for group in models.values():
        step(f"loading the tokenizer for {variants[group[0]].name}", 0, 0)
        first = Task.from_spec(variants[group[0]].spec, options.cache_dir)  # one tokenizer a model, like the model
        tasks = {n: first if n == group[0] else first.with_spec(variants[n].spec) for n in group}
        step(f"loading the model {first.source.ref}", 0, 0)
        engine = load_engine(first, options)
        for n in group:
            what = f"variant {n + 1}/{len(variants)}: {variants[n].name}"
            scorer = build_on(tasks[n], engine, options)
            out[n] = score_variant(scorer, items, rules, batching, lambda done: step(what, done, len(items)))
        del engine, scorer
        gc.collect()
    return [out[n] for n in range(len(variants))]


def score_variant(scorer: Scorer, items: Sequence[Item], rules: Sequence[Rule], batching: Batching,
                  on_batch: Callable[[int], None] = lambda done: None) -> Scored:
    """Score the items in `run`'s batches, then decide them by every rule."""
    task = scorer.task
    preps: list[Prepared] = []
    logprobs: list[list[float]] = []
    seconds = unconditional = 0.0
    on_batch(0)
    for made in task.batches(items, batching, scorer.context):
        batch = all_prepared(made)
        start = time.perf_counter()
        if task.spec.choices:  # what pmi compares each option with, scored as a pmi run does
            scorer.score_unconditional([c for p in batch for c in p.candidates.values()])
        middle = time.perf_counter()
        logprobs += scorer.score(batch).scored()
        unconditional += middle - start
        seconds += time.perf_counter() - middle
        preps += batch
        on_batch(len(preps))
    decided = {rule: decide_all(scorer.under(rule.apply(task.spec)), preps, logprobs) for rule in rules}
    return Scored(decided, len(preps), seconds, len(scorer.prefix.ids), scorer.prefix_source, unconditional)


def decide_all(scorer: Scorer, preps: Sequence[Prepared], logprobs: Sequence[Sequence[float]]) -> Decided:
    """The scorer's decisions on every item (its spec has no threshold: tune applies its own)."""
    best, top, probs = [], [], []
    for prep, lps in zip(preps, logprobs):
        decision = scorer.decide(prep, lps).decisions[0]  # a label spec asks one question
        if not isinstance(decision, Decision):  # multi-label: each label's own call
            probs.append(decision.probs)
            best.append(-1)
            top.append(0.0)
        else:
            assert decision.best is not None  # tune's scorer has no threshold: it never abstains
            best.append(decision.best)
            top.append(decision.probs[decision.best])
    return Decided(np.array(best, dtype=int), np.array(top, dtype=float),
                   np.array(probs, dtype=float).reshape(len(preps), -1) if scorer.task.spec.multi_label else None)
