"""The labelled items' and the pool's one pass for `fit` and `suggest`: the states the heads
read, and the options' scores where they are needed. The torch side of the loop: imported once a
model is needed.

The items go through the same batches as `run` forms (as a head-only run where only states are
read), and what was read is kept row by row in the state store (states.py), so a grown file,
another fold or subset reads back every row already read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from ..data.items import Item
from ..scoring.build import build_scorer
from ..scoring.options import ScoringOptions
from ..scoring.prepare import Batching, Failed, Prepared, Task, all_prepared
from ..model.rows import trie
from ..scoring.scorer import Scorer
from ..task.kind import Question
from ..task.spec import TaskSpec
from .picking import margin_of
from .states import StateStore

log = logging.getLogger(__name__)
Step = Callable[[str, int, int], None]  # (what, done, total): progress


@dataclass
class States:
    """The labelled items' pass for `fit`: per question fitted, its views ({view: [N, U, H]}), its
    options' log-probabilities [N, K] (NaN where not scored) and the prompt rule's decisions (None
    where not scored); which items had their options scored; the task's fingerprint."""

    per_question: list[tuple[dict[str, np.ndarray], np.ndarray, list]]
    scored: np.ndarray  # [N] bool: the items whose options were scored (the prompt's sample, or all)
    ms_per_item: float  # reading the states of the items not read back
    fingerprint: dict[str, str]
    kept: int = 0  # items whose states were read back from an earlier fit
    prompt_ms_per_item: float = 0.0  # scoring the options of the sampled items not read back
    forwards: int = 0  # rows that went through the model (states and scores together)


def fit_scorer(spec: TaskSpec, options: ScoringOptions, step: Step = lambda what, done, total: None,
               items: Sequence[Item] = ()) -> Scorer:
    """The scorer `read_states` reads with: the spec's prompt, no head, every option scored;
    the prefix and `items` checked against the model's context before it loads."""
    step("loading the tokenizer", 0, 0)
    task = Task.from_spec(spec, options.cache_dir)
    task.check_context(items)
    step(f"loading the model {task.source.ref}", 0, 0)
    return build_scorer(task, options.replace(prune="off", exact=False))


def _store(scorer: Scorer, fingerprint: dict[str, str], reads: Sequence, views: Sequence[str], scores: bool
           ) -> StateStore | None:
    task = scorer.task
    if task.cache_dir is None:
        return None
    return StateStore(task.cache_dir, fingerprint, scorer.engine.name, scorer.dtype, scorer.device.split(":")[0],
                      reads, views, scores)


def _kept_or_computed(batch: Sequence[Prepared], store: StateStore | None, compute: Callable[[list], list],
                      scores: bool) -> tuple[list, int, float]:
    """Per prepared item of `batch`, its row's value (`scores`: the options' log-probs, else the
    views per question): read from `store` where it holds the row, else computed in one call for
    those it lacks, and kept there. Returns the values, how many were computed and the seconds."""
    todo = [p for p in batch if store is None or store.get(p.key) is None]
    fresh, seconds = {}, 0.0
    if todo:
        start = time.perf_counter()
        values = compute(todo)
        seconds = time.perf_counter() - start
        if store is not None:
            keys = [p.key for p in todo]
            store.put(keys, values, [[] for _ in values]) if scores else store.put(keys, None, values)
        fresh = {p.key: v for p, v in zip(todo, values)}
    part = 0 if scores else 1
    out = []
    for p in batch:
        held = fresh[p.key] if p.key in fresh else store.get(p.key) if store is not None else None
        if p.key not in fresh:
            assert held is not None  # `todo` took every row the store lacks
            held = held[part]
        out.append(held)
    return out, len(todo), seconds


def read_states(scorer: Scorer, items: Sequence[Item], questions: Sequence[Question], batching: Batching,
                views: Sequence[str], prompt: int | None = None, seed: int = 0,
                step: Step = lambda what, done, total: None) -> States:
    """Read the items' `views` at each fitted question's answer position as a head-alone run
    does (each item's tokens and one candidate token an answer: no option scored), then score the
    options of `prompt` items drawn uniformly (None: as many as cost about what the states cost,
    at least PROMPT_MIN; every item when `prompt` >= N), in `run`'s batches (`scorer`: a spec
    without a head, so that its decisions are the prompt rule's). Every row is kept in the cache
    (labelled/states.py): a row an earlier fit of the same task read is read back, not forwarded."""
    task = scorer.task
    fitted = {q.id for q in questions}
    reads = [q.kind.judged_each if q.id in fitted else None for q in task.questions]
    index = [i for i, q in enumerate(task.questions) if q.id in fitted]
    fingerprint = task.head_fingerprint()
    states_store = _store(scorer, fingerprint, reads, views, False)
    scores_store = _store(scorer, fingerprint, (), (), True)
    out = States([], np.zeros(len(items), dtype=bool), 0.0, fingerprint)
    found_states: dict[int, list] = {}
    own = []
    seconds, done = 0.0, 0
    step("reading states", 0, len(items))
    position = {id(item): n for n, item in enumerate(items)}
    for made in task.batches(items, replace(batching, head_alone=True, judged=tuple(map(bool, reads))), scorer.context):
        batch = all_prepared(made)
        values, computed, took = _kept_or_computed(
            batch, states_store, lambda todo: scorer.states_alone(todo, reads, views), scores=False)
        seconds += took
        out.forwards += computed
        own += [p.own_tokens for p in batch]
        for p, found in zip(batch, values):
            found_states[position[id(p.item)]] = found
        out.kept += len(batch) - computed
        done += len(batch)
        step("reading states", done, len(items))
    out.ms_per_item = 1000 * seconds / (len(items) - out.kept) if len(items) > out.kept else 0.0
    out.scored = prompt_sample(len(items), float(np.mean(own)) if own else 1.0, option_tokens(task), prompt, seed)
    logprobs, decisions = _prompt_pass(scorer, items, out.scored, batching, index, scores_store, out, step)
    per_question = []
    for n, i in enumerate(index):
        stacked = {v: np.stack([found_states[k][n][v] for k in range(len(items))]) for v in views}
        width = len(task.questions[i].options)
        lps = np.array([lp[n] if lp is not None else [np.nan] * width for lp in logprobs], dtype=float)
        per_question.append((stacked, lps, [d[n] if d is not None else None for d in decisions]))
    out.per_question = per_question
    if out.kept:
        log.info("%d of %d items' states read back from an earlier fit of this task", out.kept, len(items))
    return out


PROMPT_MIN = 20  # items the prompt alone is measured on at least (all, where there are fewer)


def option_tokens(task: Task) -> int:
    """The tokens an item's options feed after its own (the nodes of its candidates' trie)."""
    return len(trie(list(task.builder.candidates.values())).tokens)


def prompt_sample(n: int, own: float, options: int, asked: int | None, seed: int) -> np.ndarray:
    """Which of `n` items have their options scored, [n] bool, drawn uniformly: `asked` of them,
    or (None) as many as cost about what reading every item's states cost (`own` tokens an item,
    `options` more to score its options), at least PROMPT_MIN."""
    m = asked if asked is not None else max(PROMPT_MIN, int(np.ceil(n * own / (own + options))))
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(seed + 7).permutation(n)[:min(n, m)]] = True
    return mask


def _prompt_pass(scorer: Scorer, items: Sequence[Item], scored: np.ndarray, batching: Batching, index: Sequence[int],
                 store: StateStore | None, out: States, step: Step) -> tuple[list, list]:
    """The options of the items `scored` marks, scored in `run`'s batches (rows kept in `store`):
    per item, per fitted question its log-probabilities and the prompt rule's decision (None where
    not scored)."""
    logprobs: list = [None] * len(items)
    decisions: list = [None] * len(items)
    picked = [items[int(k)] for k in np.flatnonzero(scored)]
    where = {id(items[int(k)]): int(k) for k in np.flatnonzero(scored)}
    seconds, done, computed = 0.0, 0, 0
    what = f"scoring the options of {len(picked)} items (the prompt alone, for comparison)" \
        if len(picked) < len(items) else "scoring the options (the prompt alone, and as features)"
    if picked:
        step(what, 0, len(picked))
    for made in scorer.task.batches(picked, batching, scorer.context):
        batch = all_prepared(made)
        values, fresh, took = _kept_or_computed(batch, store, lambda todo: scorer.score(todo).logprobs, scores=True)
        seconds += took
        computed += fresh
        for p, lps in zip(batch, values):
            answers = scorer.decide(p, lps)
            k = where[id(p.item)]
            logprobs[k] = [answers.logprobs[i] for i in index]
            decisions[k] = [answers.decisions[i] for i in index]
        done += len(batch)
        step(what, done, len(picked))
    out.forwards += computed
    out.prompt_ms_per_item = 1000 * seconds / computed if computed else 0.0
    return logprobs, decisions


@dataclass
class Pool:
    """The pool's pass for `suggest`: the items read, each one's state (the mean over the answer
    positions read) [N, H], and with a head, its guesses (per question it reads: the answer and its
    probability) and margin (the least sure of its questions)."""

    items: list[Item]
    vectors: np.ndarray
    answers: list[dict[str, tuple[str, float]] | None]
    margins: list[float]
    skipped: int  # items that could not be scored (too long for the model)
    ms_per_item: float


def read_pool(scorer: Scorer, items: Sequence[Item], batching: Batching,
              step: Step = lambda what, done, total: None) -> Pool:
    """The pool's states in `run`'s batches: with a head of the state alone, or none, each item's
    tokens only (as a head-only run); with a head reading the options' scores too, scored as `run`
    scores. Without a head, the state read is the first question's (where its options start)."""
    task, head = scorer.task, scorer.head is not None
    reads = scorer.reads if head else [task.questions[0].kind.judged_each] + [None] * (len(task.questions) - 1)
    alone = not head or scorer.head_only
    batching = replace(batching, head_alone=alone, judged=tuple(map(bool, reads)))  # one token an answer: as many items a batch as a head-only run
    out = Pool([], np.empty((0, 0)), [], [], 0, 0.0)
    vectors, seconds = [], 0.0
    step("reading the pool's states", 0, len(items))
    for batch in task.batches(items, batching, scorer.context):
        preps = [p for p in batch if not isinstance(p, Failed)]
        out.skipped += len(batch) - len(preps)
        if not preps:
            continue
        start = time.perf_counter()
        logprobs: Sequence[Sequence[float] | None]
        if alone:
            logprobs, states = [None] * len(preps), scorer.states_alone(preps, reads)
        else:
            logprobs, states = scorer.score_reading(preps, reads)
        seconds += time.perf_counter() - start
        for prep, lps, found in zip(preps, logprobs, states):
            out.items.append(prep.item)
            joined = [np.concatenate([q[v] for v in scorer.views], axis=-1) for q in found]  # per question [U, V*H]
            vectors.append(np.concatenate(joined).astype(np.float64).mean(axis=0))
            guesses = _guesses(scorer, prep, lps, found) if head else {}
            out.answers.append({q: (g, p) for q, (g, p, _) in guesses.items()} if head else None)
            out.margins.append(min((m for _, _, m in guesses.values()), default=1.0))
        step("reading the pool's states", len(out.items) + out.skipped, len(items))
    out.vectors = np.stack(vectors) if vectors else np.empty((0, 0))
    out.ms_per_item = 1000 * seconds / len(out.items) if out.items else 0.0
    return out


def _guesses(scorer: Scorer, prep: Prepared, logprobs, states) -> dict[str, tuple[str, float, float]]:
    """Per question the head reads ("" for a label spec's one): its guess (tags: those on, joined
    as gold values are), the guess's probability and the margin (labelled/picking.py)."""
    answers = scorer.decide_read(prep, logprobs, states)
    spec, out, head = scorer.task.spec, {}, scorer.head
    assert head is not None  # the pool is read with the spec's head
    for q, d in zip(answers.questions, answers.decisions):
        if head.readout_for(q.id) is None:
            continue
        qid = q.id if spec.questions else ""
        if hasattr(d, "on"):  # tags: each its own yes/no
            on = [o for o, yes in zip(q.options, d.on) if yes]
            sure = min((p if yes else 1 - p) for p, yes in zip(d.probs, d.on))
            out[qid] = (spec.gold_sep.join(on), float(sure), margin_of(d.probs, True, q.extra.get("thresholds")))
        else:
            best = int(np.argmax(d.probs))
            out[qid] = (q.options[best], float(d.probs[best]), float(d.margin))
    return out
