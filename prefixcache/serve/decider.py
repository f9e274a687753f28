"""Typed decisions answered by one loaded model: what the server and `decide` share, free of HTTP.

An `Ask` is one request in the batch tool's terms: a spec `{system: instructions, template:
"{state}", questions: pack}` and one item whose `state` is the request's state. So a request is
answered exactly as `prefixcache run` answers that item under that spec (the same prompt, the same
numbers). `Decider.decide` answers asks together: asks with the same instructions share one
prefilled prefix (kept, least recently used first out, in memory and in the prefix store on
disk), and all asks of one prefix go through the model in one forward pass, each ask's state once
for all its questions. A request's numbers do not depend on the others in its pass (to float
rounding): each row attends to the prefix and to itself only.

A `Batcher` (serve/batcher.py) runs a decider in one worker thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..data.items import Item
from ..errors import UsageError
from ..model.protocol import PrefixHandle
from ..model.load import model_content_identity
from ..scoring.build import build_on, load_engine, prefix_store
from ..scoring.options import ScoringOptions
from ..task.spec import PRUNING
from .tally import AnswerTally
from ..scoring.prepare import Batching, Prepared, Task, check_prefix
from ..scoring.scorer import Scorer, decide_together, prefix_stored
from ..task.questions import Answers
from ..task.head import FINGERPRINT_PARTS, Head
from ..task.keys import spec_from_mapping
from ..task.kind import shown
from .defaults import CHARS_A_TOKEN, MAX_REQUEST_TOKENS, PACKS, PREFIXES
from .errors import TooCostly, TooLarge

log = logging.getLogger(__name__)
WHOLE = Batching()  # a request costs what an item scored whole costs a batch (every option, none pruned)


@dataclass(frozen=True)
class Ask:
    """One request: the instructions (the system text: the cached prefix), the state (the item),
    and the questions in the System One shape (question id -> question)."""

    instructions: str
    state: str
    questions: Mapping[str, Any]


@dataclass(frozen=True)
class Decided:
    """An ask's answers (question id -> System One answer), what it cost in tokens and time."""

    answers: dict[str, dict[str, Any]]
    input_tokens: int  # the prompt (prefix and state) and every question and answer token read
    cached_tokens: int  # of those, the prefix tokens read from the cache instead of computed
    ms: float
    written_tokens: int = 0  # the prefix tokens computed and kept for later requests (0 when read from the cache)


def state_text(state: Any) -> str:
    """A request's state as the model reads it: text as it is, objects and arrays as JSON."""
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


def spec_of(ask: Ask) -> dict[str, Any]:
    """The spec (as a mapping) that answers an ask as `run` would: what `run` needs to give the
    same numbers for the same pack and states."""
    return {"system": shown(ask.instructions), "template": "{state}", "questions": dict(ask.questions)}


class Decider:
    """One model answering asks. `model`: a hub id, a model folder, a .gguf file or None (the
    embedded default); `prefixes`: how many prefilled prefixes to keep in memory; `packs`: how
    many question packs (their tokenised options, their calibration) to keep; `max_tokens`: the
    most tokens one request may have to score (more: refused with TooCostly, never computed)."""

    def __init__(self, model: str | None, options: ScoringOptions, prefixes: int = PREFIXES, packs: int = PACKS,
                 heads: Sequence[Head] = (), revision: str | None = None, max_tokens: int = MAX_REQUEST_TOKENS):
        if options.exact or options.prune in PRUNING:
            raise UsageError("the decisions server scores every option of every question in one precision: "
                             f"--exact and --prune {options.prune if options.prune in PRUNING else 'on'} are for "
                             "run, not for serve or decide")
        self.options = options.replace(prune="off")
        self.max_tokens = max_tokens  # tokens to score a request may have (its own and its options' trie)
        self.heads = tuple(heads)  # fitted heads: each answers the requests whose pack and prompt it was fitted on
        base = spec_from_mapping({"labels": ["yes", "no"], **({"model": model} if model else {}),
                                  **({"revision": revision} if revision else {})})
        self.base = Task.from_spec(base, options.cache_dir)
        self.engine = load_engine(self.base, options)
        self.name = Path(self.base.source.path).name.removesuffix(".gguf") if self.base.source.kind != "hub" \
            else self.base.source.ref  # the served model, as answers name it
        self._prefixes: OrderedDict[tuple[int, ...], PrefixHandle] = OrderedDict()
        self.tally = AnswerTally(packs)  # answers per pack and question: a collapse is said once
        self._packs: OrderedDict[str, Scorer] = OrderedDict()  # a pack's scorer: its task, calibration, prefix
        self._tasks: OrderedDict[str, Task] = OrderedDict()  # a pack made ready, its scorer not made yet
        self._store = prefix_store(self.options)
        self.max_prefixes, self.max_packs = prefixes, packs
        self.lock = threading.Lock()  # one forward at a time: `decide` is called from one worker thread
        self._model_id = model_content_identity(self.base.source, self.options.cache_dir) if self.heads else None
        self.why_no_head: dict[str, str] = {}  # pack key -> why no served head answers it (said once)
        for head in self.heads:
            head.check_width(self.engine.hidden_size, self.engine.layers)

    @property
    def context(self) -> int | None:
        return self.engine.max_positions

    @property
    def prefixes_in_memory(self) -> int:
        """Prefilled prefixes held in memory (by the prefix cache or a kept pack): at most `max_prefixes`."""
        return len({id(p) for p in self._prefixes.values()} | {id(s.prefix) for s in self._packs.values()})

    def _task(self, ask: Ask, key: str) -> tuple[Task, bool]:
        """The task of the ask's pack (`key`: its `pack_key`), tokenised but not run, and whether
        its prefix is held already (in memory or in the prefix store: read back, not computed).
        No model work: a prefix to prefill is a cost the pass that takes the ask pays."""
        if key in self._packs:
            self._packs.move_to_end(key)
            return self._packs[key].task, True
        task = self._tasks.pop(key, None)
        if task is None:
            task = self.base.with_spec(spec_from_mapping(spec_of(ask), "request"))
            if self.heads:  # a head fitted on exactly this pack, prompt and model answers it
                found = task.head_fingerprint(self._model_id)
                head = next((h for h in self.heads if dict(h.fingerprint) == found), None)
                if head is not None:
                    task = self.base.with_spec(dataclasses.replace(task.spec, head=head))
                else:
                    self._no_head(key, found)
        self._tasks[key] = task
        while len(self._tasks) > self.max_packs:
            self._tasks.popitem(last=False)
        ids = tuple(task.builder.prefix_ids)
        check_prefix(len(ids), self.context)
        return task, ids in self._prefixes or prefix_stored(task, self.engine, self._store)

    def _scorer(self, ready: Ready) -> tuple[Scorer, bool]:
        """The scorer of a ready ask's pack, and whether making it prefilled the prefix (the
        first ask of a new pack); kept for the pack's next asks."""
        key = ready.pack
        if key in self._packs:
            self._packs.move_to_end(key)
            return self._packs[key], False
        task = ready.task
        ids = tuple(task.builder.prefix_ids)
        computed = False
        if ids in self._prefixes:
            self._prefixes.move_to_end(ids)
            scorer = build_on(task, self.engine, self.options, self._prefixes[ids])
        else:  # from the prefix store on disk, else prefilled (and kept there)
            scorer = build_on(task, self.engine, self.options)
            computed = scorer.prefix_source != "loaded"
            self._prefixes[ids] = scorer.prefix
            while len(self._prefixes) > self.max_prefixes:
                _, gone = self._prefixes.popitem(last=False)
                for old in [k for k, s in self._packs.items() if s.prefix is gone]:  # nothing keeps it alive
                    del self._packs[old]
        self._tasks.pop(key, None)
        self._packs[key] = scorer
        while len(self._packs) > self.max_packs:
            self._packs.popitem(last=False)
        return scorer, computed

    def _no_head(self, key: str, found: Mapping[str, str]) -> None:
        """Say, once a pack and in its answers (`x_readout_why`), why no served head answers it:
        what differs from the head closest to it."""
        if key in self.why_no_head:
            return
        closest = max(self.heads, key=lambda h: sum(h.fingerprint.get(p) == found.get(p) for p in FINGERPRINT_PARTS))
        differs = [what for p, what in FINGERPRINT_PARTS.items() if closest.fingerprint.get(p) != found.get(p)]
        why = (f"the served head {closest.path} was fitted with another {differs[0]}"
               if differs else "no served head was fitted on this pack")
        if len(self.why_no_head) >= self.max_packs:
            self.why_no_head.pop(next(iter(self.why_no_head)))
        self.why_no_head[key] = why
        log.info("a request's questions are answered by the prompt, not a head: %s (a head answers a pack only as it "
                 "was fitted: the same questions, instructions and model)", why)

    def decide(self, asks: Sequence[Ask]) -> list[Decided | Exception]:
        """Answer asks together: per ask its answers, or the library error that refused it
        (SpecError: a pack `run` would refuse; TooLong: a state beyond the model's context;
        TooCostly: more tokens to score than `max_tokens`)."""
        start = time.perf_counter()
        ready = self.ready(asks)
        todo = [r for r in ready if isinstance(r, Ready)]
        try:
            done: list[Decided | Exception] = list(self.decide_ready(todo))
        except Exception:  # noqa: BLE001 - the pass failed (a new pack's scorer, say): each ask alone, its failure its own
            done = []
            for r in todo:
                try:
                    done += self.decide_ready([r])
                except Exception as exc:  # noqa: BLE001 - answered with its error, as `ready` answers
                    done.append(exc)
        decided = iter(done)
        out = [next(decided) if isinstance(r, Ready) else r for r in ready]
        ms = (time.perf_counter() - start) * 1000
        return [dataclasses.replace(d, ms=ms) if isinstance(d, Decided) else d for d in out]

    def ready(self, asks: Sequence[Ask]) -> list[Ready | Exception]:
        """Each ask's pack and prepared row with its cost in tokens (a prefix not held yet
        counted in), or the error refusing it; nothing runs the model."""
        out: list[Ready | Exception] = []
        with self.lock:
            for i, ask in enumerate(asks):
                try:
                    check_size(ask, self.max_tokens)
                    pack = pack_key(ask)
                    task, held = self._task(ask, pack)
                    prep = task.prepare(Item(f"request {i}", {"state": ask.state}, 1), self.context)
                    alone = task.spec.head_alone(self.options.prompt_scores)
                    scored = WHOLE.answering(task.spec, alone).cost(prep)  # its tokens, its options' trie
                    cost = scored + (0 if held else prep.enc.prefix_len)
                    if cost > self.max_tokens:
                        raise TooCostly(cost, self.max_tokens, 0 if held else prep.enc.prefix_len)
                    out.append(Ready(ask, pack, task, prep, held, cost, self.why_no_head.get(pack)))
                except Exception as exc:  # noqa: BLE001 - a refused ask is answered with its error
                    out.append(exc)
        return out

    def decide_ready(self, ready: Sequence[Ready]) -> list[Decided]:
        """The answers of asks made ready (`ready`), in one forward pass per prefix (a new
        prefix prefilled first, once for all its asks)."""
        start = time.perf_counter()
        with self.lock:
            made = [self._scorer(r) for r in ready]
            decided = decide_together([(scorer, r.prep) for (scorer, _), r in zip(made, ready, strict=True)])
            out = [_decided(r, scorer, answers, not computed)
                   for r, (scorer, computed), answers in zip(ready, made, decided, strict=True)]
            for r, (scorer, _), d in zip(ready, made, out, strict=True):
                self.tally.add(r.pack, scorer.task.questions, d.answers)
        ms = (time.perf_counter() - start) * 1000
        return [dataclasses.replace(d, ms=ms) for d in out]


@dataclass(frozen=True)
class Ready:
    """An ask made ready to score: its pack (`pack_key`) and the pack's task, its prepared row,
    whether its prefix was held already (in memory or the prefix store), and its cost: its own
    tokens, its options' trie, and its prefix's tokens when it must be prefilled."""

    ask: Ask
    pack: str
    task: Task
    prep: Prepared
    cached: bool
    cost: int
    why_no_head: str | None = None  # heads are served and none answers this pack: why


def check_size(ask: Ask, max_tokens: int) -> None:
    """Refuse (TooLarge) an ask whose instructions, state and questions hold more characters than
    `max_tokens` tokens can hold: known from its size alone, before anything is tokenised (a 1 MB
    field would otherwise hold the worker for as long as tokenising it takes)."""
    chars = _characters(ask.instructions) + _characters(ask.state) + _characters(ask.questions)
    if chars > max_tokens * CHARS_A_TOKEN:
        raise TooLarge(chars, max_tokens, CHARS_A_TOKEN)


def _characters(value: Any) -> int:
    """The characters of the strings in a parsed JSON value (keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(len(str(k)) + _characters(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_characters(v) for v in value)
    return 0


def pack_key(ask: Ask) -> str:
    """An ask's pack (its instructions and questions) as canonical JSON."""
    return json.dumps([ask.instructions, ask.questions], ensure_ascii=False, sort_keys=True, default=str)


def _decided(ready: Ready, scorer: Scorer, answers: Answers, cached: bool) -> Decided:
    """An ask's answers in the System One shape (a head's marked `x_readout`) and its usage: the
    tokens read are the prefix's and those it scored; `cached`: its prefix was not computed for it."""
    shaped = answers.answers()
    for q, r in zip(scorer.task.questions, scorer.reads, strict=True):
        if r is not None:  # answered by the fitted head, not the prompt's scores
            shaped[q.id]["x_readout"] = "head"
        elif ready.why_no_head:
            shaped[q.id].update(x_readout="prompt", x_readout_why=ready.why_no_head)
    prefix = ready.prep.enc.prefix_len
    scored = ready.cost - (0 if ready.cached else prefix)
    return Decided(shaped, prefix + scored, prefix if cached else 0, 0.0, 0 if cached else prefix)
