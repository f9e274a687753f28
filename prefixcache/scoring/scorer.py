"""A task's model at work: the engine, the prefilled prefix, and the scores and decisions of
prepared items. The scoring API every entry point shares; scorers are built by build.py.

Example:
    scorer = build_scorer(task, ScoringOptions.from_environment(device="cpu", dtype="float32"))
    for batch in task.batches(items, Batching(), scorer.context):
        preps = [p for p in batch if isinstance(p, Prepared)]
        for prep, logprobs in zip(preps, scorer.score(preps)):
            answers = scorer.decide(prep, logprobs)   # per question: its decision and options' log-probs
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Hashable, Iterable, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from .. import compat
from ..model.protocol import PrefixHandle, ScoringEngine
from ..model.choice import pick_engine
from ..model.engines import Backend, Load, backend_named, default_backend, fits, open_engine
from ..model.memory import float32_bytes
from ..model.load import model_identity
from ..model.rows import Candidate, Row, trie
from ..data.items import Item
from ..task.decision import Bounded, Groups, linear_keys, mean_distribution
from ..model.store import PrefixStore, prefix_key
from ..task.features import Features, views_of
from .reading import Reading, probe_of
from ..task.questions import Answers
from ..task.spec import PRUNING, TaskSpec
from .prepare import Batching, Prepared, Task, check_prefix
from .pruning import MASS, Contest, score_pruned

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)
MIN_RACE_TOKENS = 128  # candidate tokens an item from which pruning may pay (measured: 93 tokens 0.94x, 180 1.07x)


def load_engine(task: Task, cache_dir: Path, device: str = "auto", dtype: str = "auto", backend: str | None = None,
                threads: int | None = None, why: str | None = None) -> ScoringEngine:
    """The task's model on `device` in `dtype` ("auto": see model/load.py), as an engine of the
    backend asked (None: the spec's, else auto: model/choice.py); its limits checked and its memory
    said first, a model that would not fit refused before it loads (model/engines.py). `why`: the
    reason to log for the engine when the program, not the user, named it (--exact's twin)."""
    picked = pick_engine(task.source, backend or task.spec.backend, device, dtype,
                         float32_bytes=float32_bytes(task.source, cache_dir))
    chosen = backend_named(picked.name)
    # a GGUF file may run quantised or expanded: which, and why, is said for every one
    asked = chosen is not default_backend() or backend or task.spec.backend or task.source.kind == "gguf"
    said = log.info if asked else log.debug
    reason = why or picked.why
    said("backend: %s%s%s", picked.name, _computing(chosen, device, dtype), f" ({reason})" if reason else "")
    return open_engine(chosen, _load_of(task, cache_dir, device, dtype, threads))


def check_fits(task: Task, cache_dir: Path, device: str, dtype: str, backend: str) -> None:
    """Refuse (ModelError, one line), without loading it, a model that `load_engine` would refuse
    for the memory it takes: said now where it would otherwise load later (--exact's float32 twin)."""
    chosen = backend_named(backend)
    need, where = chosen.footprint(_load_of(task, cache_dir, device, dtype))
    fits(task.source, need, where, chosen, say=False)  # said when (and if) it loads


def _load_of(task: Task, cache_dir: Path, device: str, dtype: str, threads: int | None = None) -> Load:
    same = None if task.spec.choices else tuple(task.builder.candidates.values())  # known before the model loads
    return Load(task.source, task.tokenizer, cache_dir, device, dtype, threads, len(task.builder.prefix_ids),
                BATCH_TOKENS, same)


def _computing(backend: Backend, device: str, dtype: str) -> str:
    """", in bfloat16": the precision the engine will compute in, in words."""
    from ..model.load import dtype_name, pick_device

    return f", {backend.precision(dtype_name(dtype, pick_device(device)))}"


BATCH_TOKENS = Batching.tokens  # the keys and values of a batch the estimate counts: the run pipeline's default budget


V = TypeVar("V")
States = list[dict[str, np.ndarray]]  # an item's, per question read by a head: its views' states


class ScoreCache(Generic[V]):
    """The most recently used prompts' scores (or states), so duplicate items are scored once."""

    def __init__(self, size: int = 65536):
        self.size = size
        self._data: OrderedDict[Hashable, V] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def get(self, key: Hashable) -> V:
        self._data.move_to_end(key)
        return self._data[key]

    def peek(self, key: Hashable) -> V:
        return self._data[key]

    def put(self, key: Hashable, scores: V) -> None:
        self._data[key] = scores
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)


class ItemScorer(Protocol):
    """What the run pipeline asks of a scorer (`Scorer`, and `CheckedScorer` for --exact)."""

    task: Task
    engine: ScoringEngine
    prefix: PrefixHandle
    prefix_source: str  # "computed" or "loaded" (from the prefix store)
    load_seconds: float
    device: str
    dtype: str

    @property
    def context(self) -> int | None: ...

    def score(self, preps: Sequence[Prepared], known: Mapping[tuple, list[float]] | None = None) -> Scores: ...

    def decide(self, prep: Prepared, logprobs: Sequence[float] | None) -> Answers: ...

    says_pruned: bool

    def prune(self, mode: str = "auto", exact: bool = False) -> bool: ...

    @property
    def pruning(self) -> bool: ...

    def precision(self, key: tuple) -> str | None: ...

    def score_unconditional(self, candidates: Sequence[Candidate], skips: Sequence[int] = ()) -> None: ...

    def rescoring(self) -> Rescoring | None: ...

    def exact_bound(self) -> float | None: ...

    def carry_bound(self, bound: float) -> bool: ...

    def calibration_items(self) -> int: ...

    def calibrate(self, items: Iterable[Item]) -> None: ...


class Scorer:
    """Scores prepared items of one task against its cached prefix.

    Attributes:
        task, engine, prefix (the prefilled prefix), prefix_source ("computed" or "loaded"),
        prior (calibration: per question asked, its distribution on content-free inputs; or None),
        load_seconds (loading the model), device, dtype (as text).
    """

    def __init__(self, task: Task, engine: ScoringEngine, prefix: PrefixHandle, prefix_source: str = "computed",
                 load_seconds: float = 0.0, says_precision: bool = False, unconditional: ScoreCache | None = None,
                 prompt_scores: bool = False):
        self.task, self.engine, self.prefix = task, engine, prefix
        self.prefix_source, self.load_seconds = prefix_source, load_seconds
        self.device = str(engine.device)
        self.dtype = engine.precision
        self.prior: list[list[float] | None] | None = None  # per question asked: its calibration prior
        self.says_precision = says_precision  # records name their precision (a run asked for --exact)
        self._scores: ScoreCache[list[float] | None] = ScoreCache()  # None: a head answered alone
        self._unconditional: ScoreCache[float] = unconditional if unconditional is not None else ScoreCache()
        asked = task.builder.asked
        if any(q.normalize == "pmi" for q in asked):
            self.score_unconditional(list(task.builder.candidates.values()), task.builder.skips)
        if any(q.content_free for q in asked):
            self.prior = self._priors()
        self._contests: list[Contest] | None = None  # set by `prune`: what score_pruned races
        self.says_pruned = False  # records name the labels left at their bound (`prune`)
        self.reading = Reading.of(task, engine, prompt_scores)  # what its head reads, and whether it answers alone
        self.head = self.reading.head
        self._states: ScoreCache[States] = ScoreCache()  # by prompt: per question read by the head, its answer states

    @property
    def head_only(self) -> bool:
        """The head answers alone: no option is scored (scoring/reading.py)."""
        return self.reading.alone

    @property
    def views(self) -> tuple[str, ...]:
        return self.reading.views

    @classmethod
    def load(cls, task: Task, cache_dir: Path, device: str = "auto", dtype: str = "auto",
             store: PrefixStore | None = None, says_precision: bool = False, backend: str | None = None,
             threads: int | None = None, prompt_scores: bool = False, why: str | None = None) -> Self:
        """Load the task's model and get the prefilled prefix: from `store` when it has it, else by
        prefilling (and then keeping it there). `says_precision`: records name the precision that
        scored them. `backend`, `threads`: as `load_engine`. `prompt_scores`: a head that could
        answer alone has the options scored too (scoring/reading.py)."""
        start = time.perf_counter()
        engine = load_engine(task, cache_dir, device, dtype, backend, threads, why)
        return cls.on(task, engine, store, time.perf_counter() - start, says_precision, prompt_scores)

    @classmethod
    def on(cls, task: Task, engine: ScoringEngine, store: PrefixStore | None = None, load_seconds: float = 0.0,
           says_precision: bool = False, prompt_scores: bool = False) -> Self:
        """A scorer on a model already loaded, its prefix from `store` when it has it, else
        prefilled (and then kept there)."""
        check_prefix(len(task.builder.prefix_ids), engine.max_positions)
        prefix, source = _prefix(task, engine, store)
        return cls(task, engine, prefix, source, load_seconds, says_precision, prompt_scores=prompt_scores)

    @classmethod
    def start(cls, task: Task, engine: ScoringEngine) -> "Scorer":
        """A scorer on a model already loaded (the prefix is prefilled, not stored)."""
        return cls(task, engine, engine.prefill(task.builder.prefix_ids))

    def under(self, spec: TaskSpec) -> "Scorer":
        """This scorer deciding as `spec` says: its normalisation, calibration and threshold, on the
        same prompt (only those keys may differ from this task's spec), model and prefix. Label
        scores and content-free scores are shared, so `decide` gives what a run of `spec` gives."""
        task = self.task.with_spec(spec)
        if task.builder.prefix_ids != self.task.builder.prefix_ids:
            raise ValueError("under(): the spec's prompt differs from this scorer's")
        return Scorer(task, self.engine, self.prefix, self.prefix_source, unconditional=self._unconditional,
                      prompt_scores=self.reading.prompt_scores)

    @property
    def context(self) -> int | None:
        """The model's limit on positions (None when it states none)."""
        return self.engine.max_positions

    # -- scores -------------------------------------------------------------------------------
    def score(self, preps: Sequence[Prepared], known: Mapping[tuple, list[float]] | None = None) -> Scores:
        """Summed log-probs of each item's candidates, in candidate order. Prompts not seen
        recently go through the model in one forward pass; `known` (by `Prepared.key`) supplies
        scores read back from an earlier run's records instead: what this pass would compute."""
        if self.head is not None and known is not None:  # records written: nothing is decided again
            return Scores([known[p.key] for p in preps], [])
        if self.head is not None:
            return self._score_with_states(preps)
        todo = {p.key: p for p in preps if p.key not in self._scores}
        if todo and known is not None:
            for key in todo:
                self._scores.put(key, known[key])
        elif todo and self._contests is not None:
            values = score_pruned(self.engine, self.prefix, list(todo.values()), self._contests)
            for prep, scores in zip(todo.values(), values):
                self._scores.put(prep.key, _combined(prep.groups, scores))
        elif todo:
            for prep, scored in zip(todo.values(), self.engine.score(self.prefix, [p.row for p in todo.values()])):
                self._scores.put(prep.key, prep.groups.combine(scored))
        computed = [] if known is not None else list(todo.values())
        return Scores([self._scores.get(p.key) for p in preps], computed)  # get: recency, the same in every run

    def _score_with_states(self, preps: Sequence[Prepared]) -> Scores:
        """`score` for a spec with a head: every option scored to the end (the prompt's
        log-probabilities are kept in the records) and, from the same forward, the states the head
        reads. (A batch whose records are all written is not scored: `score` returns the scores
        read back from them, and nothing of it is decided again.)"""
        todo = {p.key: p for p in preps if p.key not in self._scores or p.key not in self._states}
        if todo and self.head_only:
            for key, found in zip(todo, self.states_alone(list(todo.values()))):
                self._scores.put(key, None)
                self._states.put(key, found)
        elif todo:
            values, states = self.score_reading(list(todo.values()), self.reads)
            for key, scores, found in zip(todo, values, states):
                self._scores.put(key, scores)
                self._states.put(key, found)
        return Scores([self._scores.get(p.key) for p in preps], list(todo.values()))

    def states_alone(self, preps: Sequence[Prepared], reads: Sequence[bool | None] | None = None,
                     views: Sequence[str] | None = None) -> list[list[dict[str, np.ndarray]]]:
        """The views the head reads (or those `reads` and `views` ask for, as `score_reading`
        takes them), per item and question, from a forward of the item's tokens and, per answer
        position, the candidate's context (a question's text) and its first token."""
        return self.reading.forward(self.engine, self.prefix, self.task, preps, False, reads, views)[1]

    @property
    def reads(self) -> list[bool | None]:
        """Per question asked, what its head reads: None (no head), False (the state where its
        options start), True (each option judged yes/no: the state where each one's is scored)."""
        return list(self.reading.reads)

    def score_reading(self, preps: Sequence[Prepared], reads: Sequence[bool | None],
                      views: Sequence[str] | None = None
                      ) -> tuple[list[list[float]], list[list[dict[str, np.ndarray]]]]:
        """Each item's options' log-probabilities (as `score` gives them, every option to the
        end) and, per question whose `reads[i]` is not None, the views at its answer position:
        each [1, H], or [K, H] where `reads[i]` is True (each option judged yes/no at its own).
        Both from one forward pass."""
        values, states = self.reading.forward(self.engine, self.prefix, self.task, preps, True, reads, views)
        assert values is not None  # every option scored
        return values, states

    def prune(self, mode: str = "auto", exact: bool = False) -> bool:
        """Pruned label scoring, as `TaskSpec.prunes` says for `mode` ("auto", "on", "exact",
        "off"): records then say which labels are bounds (`says_pruned`), and labels are pruned
        where the model's attention allows (model/branches.py; elsewhere every label is scored,
        and "on"/"exact" say so). "exact" races for exact probabilities too (`Contest.mass`).
        Returns whether labels are pruned."""
        spec = self.task.spec
        self.says_pruned = spec.prunes(mode, exact)
        why = spec.pruning_refusal() if mode in PRUNING and not exact else None
        contests = self._contests_of(MASS if mode == "exact" else None) if self.says_pruned else None
        raced = self._raced_tokens(contests) if contests else 0
        if self.says_pruned and not self.engine.branches:
            why = f"the {self.engine.name} engine cannot keep this model's items between passes"
        elif contests and raced < MIN_RACE_TOKENS:
            why = (f"{raced} candidate tokens an item are too few for a race to pay (from {MIN_RACE_TOKENS}: each step "
                   f"of a race is a forward pass)")
        if why:
            log.warning("--prune %s: every label is scored to the end: %s", mode, why)
        if not self.says_pruned or why:
            self._contests = None
            return False
        self._contests = contests
        return True

    def _raced_tokens(self, contests: Sequence[Contest]) -> int:
        """The tokens full scoring runs for the candidates a race may leave (a question's text aside)."""
        ids = list(self.task.builder.candidates.values())
        return sum(len(trie(ids[c.at:c.end]).tokens) - c.skip for c in contests if c.race)

    def _contests_of(self, mass: float | None) -> list[Contest]:
        """One contest per question asked: a question of a kind that races (a choice, a label
        set) whose options have one text each is raced, every other one scored to the end."""
        builder, contests = self.task.builder, []
        ids = list(builder.candidates.values())
        for i, q in enumerate(builder.asked):
            at, end = builder.spans[i]
            skip, prior = builder.skips[at] if builder.skips else 0, self.prior[i] if self.prior else None
            if not q.kind.races or not q.groups.plain:
                contests.append(Contest(at, end, skip, race=False))
                continue
            uncond = [self.unconditional(c) for c in ids[at:end]] if q.normalize == "pmi" else []
            keys = _reported_keys(q.normalize, [len(c) - skip for c in ids[at:end]], list(q.texts), uncond, prior)
            contests.append(Contest(at, end, skip, keys, q.threshold, mass=mass))
        return contests

    @property
    def pruning(self) -> bool:
        return self._contests is not None

    def precision(self, key: tuple) -> str | None:
        """Which precision produced the scores of a prompt, when the run's records say so (runs
        that may mix two: `says_precision`), else None."""
        return self.dtype if self.says_precision else None

    def clear(self) -> None:
        """Forget the scores of earlier items (e.g. between timed runs of the same items)."""
        self._scores = ScoreCache()

    def rescoring(self) -> Rescoring | None:
        """What a scorer that scores close calls again in float32 did (None: this one does not)."""
        return None

    def exact_bound(self) -> float | None:
        """--exact: the gap under which calls are scored again in float32, as it stands (None:
        this scorer re-scores nothing, or has measured nothing yet)."""
        return None

    def carry_bound(self, bound: float) -> bool:
        """--exact continuing an output: start from the bound its earlier run had reached, not one
        measured anew. Returns whether this scorer takes one (one that re-scores nothing does not)."""
        return False

    def calibration_items(self) -> int:
        """How many of the input's first items `calibrate` wants before any is scored (0: none)."""
        return 0

    def calibrate(self, items: Iterable[Item]) -> None:
        """Measure what the scorer's decisions rest on from the input's first items (--exact: its
        gap bound); this one measures nothing."""

    def score_unconditional(self, candidates: Sequence[Candidate], skips: Sequence[int] = ()) -> None:
        """Score the candidates not seen yet after the content-free prompt (every template field
        empty), in a forward pass of their own, so the values never depend on a batch. `skips`:
        per candidate, its leading ids read, not scored (a typed question's text)."""
        skip = dict(zip(candidates, skips))
        todo = list(dict.fromkeys(c for c in candidates if c not in self._unconditional))
        if todo:
            cf = self.task.content_free("")
            row = Row(cf.ids, cf.prefix_len, todo, [skip[c] for c in todo] if skips else ())
            for cand, lp in zip(todo, self.engine.score(self.prefix, [row])[0]):
                self._unconditional.put(cand, lp)

    def unconditional(self, candidate: Candidate) -> float:
        """A candidate's log-prob after the content-free prompt (scored by `score_unconditional`)."""
        return self._unconditional.peek(candidate)

    # -- decisions ----------------------------------------------------------------------------
    def decide(self, prep: Prepared, logprobs: Sequence[float] | None) -> Answers:
        """What the item's scores (one per option, its texts combined) decide for each question
        this scorer's spec asks (its normalisation, calibration, threshold), each from its own
        part: a question's numbers never depend on another's. With a head, the questions it reads
        are decided by it, from the states scored with the item (`score`)."""
        return self.decide_read(prep, logprobs, self._states.peek(prep.key) if self.head is not None else [])

    def scores_of(self, key: Hashable) -> list[float]:
        """An item's options' scores, as `score` left them (a head that answered alone scored none)."""
        scores = self._scores.peek(key)
        if scores is None:
            raise ValueError("the head answered this item alone: its options were not scored")
        return scores

    def decide_read(self, prep: Prepared, logprobs: Sequence[float] | None, states: Sequence[Mapping[str, np.ndarray]]
                    ) -> Answers:
        """`decide`, the head reading `states` (per question it reads, as `score_reading` gives them)."""
        if logprobs is None:  # the head answered alone: no option was scored
            return self.reading.answers(self.task.asked(prep), states)
        return self.reading.answers(self._answers(prep, logprobs, self.prior), states)

    def _answers(self, prep: Prepared, logprobs: Sequence[float],
                 priors: Sequence[Sequence[float] | None] | None) -> Answers:
        ids, skips, asked = list(prep.candidates.values()), prep.skips, self.task.asked(prep)
        decisions, parts = [], []
        for i, (q, (at, end), (a, b)) in enumerate(zip(asked, prep.spans, prep.parts)):
            counts = [len(c) - (skips[k] if skips else 0) for k, c in enumerate(ids[at:end], at)]
            uncond: list[float] = []
            if q.normalize == "pmi":
                self.score_unconditional(ids[at:end], skips[at:end])  # an item's own options: once each
                uncond = [self.unconditional(c) for c in ids[at:end]]
            part = tuple(logprobs[a:b])
            decisions.append(q.kind.decide(q, part, counts, uncond, priors[i] if priors else None))
            parts.append(part)
        return Answers(asked, tuple(decisions), tuple(parts))

    def _priors(self) -> list[list[float] | None]:
        """Per calibrated question, its mean distribution over its content-free inputs (every
        template field set to one of them), each scored like an item (only the calibrated
        questions' candidates go through the model); None for the others."""
        builder, asked = self.task.builder, self.task.builder.asked
        ids = list(builder.candidates.values())
        picked = [k for q, span in zip(asked, builder.spans) if q.content_free for k in range(*span)]
        texts = list(dict.fromkeys(t for q in asked for t in q.content_free))
        encoded = {t: self.task.content_free(t) for t in texts}
        rows = [Row(e.ids, e.prefix_len, [ids[k] for k in picked], [builder.skips[k] for k in picked] if builder.skips
                    else ()) for e in encoded.values()]
        decided = {}
        for t, lps in zip(texts, self.engine.score(self.prefix, rows)):
            scores = [0.0] * len(ids)  # the uncalibrated questions' candidates are not scored: no prior asks them
            for k, lp in zip(picked, lps):
                scores[k] = lp
            free = Prepared(Item(f"content-free {t!r}", {}, 0), encoded[t], builder.candidates, builder.groups,
                            builder.spans, builder.parts, builder.skips)
            decided[t] = self._answers(free, builder.groups.combine(scores), None).decisions
        return [mean_distribution([decided[t][i].probs for t in q.content_free]) if q.content_free else None
                for i, q in enumerate(asked)]


def decide_together(asked: Sequence[tuple[Scorer, Prepared]]) -> list[Answers]:
    """Items of several scorers on one engine (a server's requests: each its own pack of
    questions) decided in as few forward passes as their prefixes allow: the items of scorers that
    share a prefilled prefix go through one pass, with the states their heads read; each is
    decided by its own scorer (normalisation, calibration, thresholds, head). In input order.
    Every option is scored to the end (no pruning, one precision), but where a scorer's head
    answers alone (`head_only`): its items feed their tokens and one candidate token an answer."""
    out: list[Answers | None] = [None] * len(asked)
    by_prefix: dict[int, list[int]] = {}
    for i, (scorer, _) in enumerate(asked):
        by_prefix.setdefault(id(scorer.prefix), []).append(i)
    for members in by_prefix.values():
        first = asked[members[0]][0]
        rows, wanted = [], []
        for i in members:
            scorer, prep = asked[i]
            row, want = scorer.reading.row(scorer.task, prep)
            rows.append(row)
            wanted.append(want)
        views = views_of([Features(asked[i][0].views) for i in members])
        states: Sequence[Any]
        if any(wanted):  # some scorer's head reads states: from the same forward
            scores, states = first.engine.score_with_states(first.prefix, rows, wanted, probe_of(views))
        else:
            scores, states = first.engine.score(first.prefix, rows), [None] * len(members)
        for i, lps, found in zip(members, scores, states):
            scorer, prep = asked[i]
            read = scorer.reading.split(prep, found, views=views) if found is not None else []
            out[i] = scorer.decide_read(prep, None if scorer.head_only else prep.groups.combine(lps), read)
    return out  # type: ignore[return-value]


def _combined(groups: Groups, scores: Sequence[float]) -> list[float]:
    """Per option, its scored texts' log-probabilities combined; the positions of bounds (pruned
    scoring, whose raced options have one text each) follow their option."""
    if groups.plain:
        return scores if isinstance(scores, Bounded) else list(scores)
    out = groups.combine(scores)
    pruned = getattr(scores, "pruned", ())
    if not pruned:
        return out
    option = {m[0]: i for i, m in enumerate(groups.members) if len(m) == 1}
    return Bounded(out, [option[k] for k in pruned])


def _reported_keys(normalize: str, counts: list[int], texts: list[str], uncond: list[float],
                   prior: Sequence[float] | None) -> list[tuple[list[float], list[float]]]:
    """A contest's ranking keys for every distribution its records report: the decision's, and
    with calibration the raw one too (its probabilities are kept exact as well)."""
    keys = [linear_keys(normalize, counts, texts, uncond, prior)]
    if prior:
        keys.append(linear_keys(normalize, counts, texts, uncond))
    return keys


@dataclass(frozen=True)
class Rescoring:
    """`--exact`: items scored again in float32, of the items scored, the gap bound, and the
    re-scored items that rounding moved further than it."""

    rescored: int
    scored: int
    bound: float
    beyond: int = 0


@dataclass(frozen=True)
class Scores:
    """A batch's scores: per item, the summed log-prob of each candidate; and the items whose
    prompts went through the model (the rest reused recent or known scores)."""

    logprobs: list[list[float] | None]  # None: a head answered alone (no option scored)
    computed: list[Prepared]

    def scored(self) -> list[list[float]]:
        """Every item's scores (a scorer without a head scores every option)."""
        if any(lps is None for lps in self.logprobs):
            raise ValueError("a head answered some items alone: their options were not scored")
        return [lps for lps in self.logprobs if lps is not None]


def stored_key(task: Task, engine: ScoringEngine) -> str | None:
    """The prefix store's key of the task's prefix on `engine` (None: the engine keeps none)."""
    if not backend_named(engine.name).stores_prefix:
        return None
    identity = model_identity(task.source)
    if task.source.kind == "hub":  # the revision actually loaded, so a new upload misses
        identity += "@" + str(compat.hub_revision(task.source.path))
    return prefix_key(identity, engine.name, backend_named(engine.name).version(engine.precision), engine.precision,
                      str(engine.device).split(":")[0], task.builder.prefix_ids)


def prefix_stored(task: Task, engine: ScoringEngine, store: PrefixStore | None) -> bool:
    """Whether the task's prefix is in `store` (read back, not computed, when the scorer is made)."""
    key = stored_key(task, engine) if store is not None else None
    return store is not None and key is not None and store.has(key)


def _prefix(task: Task, engine: ScoringEngine, store: PrefixStore | None) -> tuple[PrefixHandle, str]:
    """The prefilled prefix and where it came from ("loaded" from the store, or "computed")."""
    ids = task.builder.prefix_ids
    key = stored_key(task, engine) if store is not None else None
    if store is None or key is None:
        return engine.prefill(ids), "computed"
    prefix = store.load(key, engine)
    if prefix is not None and prefix.ids == tuple(ids):
        return prefix, "loaded"
    return store.save(key, engine.prefill(ids), task.source.ref, engine), "computed"
