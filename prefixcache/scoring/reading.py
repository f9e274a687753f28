"""What a scorer's fitted head reads of each forward and how it answers: one value (`Reading`),
fixed when the scorer is built. Every entry point (`run`, `bench`, the Python API, Ray, `serve`,
`decide`, `fit`'s and `suggest`'s passes) asks it, never the head directly.

A head reads, per question it answers, views of the forward (task/features.py) at the question's
answer position(s). It **answers alone** when every question asked has a head of views alone
and the options' scores were not asked for (`prompt_scores`): then an item's forward feeds its own
tokens and, per answer position, the candidate's context (a typed question's text) and first
token only (`alone_row`), and no option is scored.

Example:
    reading = Reading.of(task, engine, prompt_scores=False)
    row, wanted = reading.row(task, prep)      # what one forward feeds for the item
    _, found = engine.score_with_states(prefix, [row], [wanted], probe_of(reading.views))
    views = reading.split(prep, found[0])      # per question read: {view: [U, H]}
    answers = reading.answers(prompt_answers, views)   # the questions it reads decided by the head
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..model.rows import Probe, Row
from ..task.decision import Decision, Tags
from ..task.features import Features, layer_of
from ..task.head import Head, Readout, decided_by
from ..task.kind import Question
from ..task.questions import Answers

log = logging.getLogger(__name__)
PLAIN = ("state",)  # the final state at the answer position: what every engine reads


def precision_of(engine: Any) -> str:
    """What an engine computes in, in words: a torch dtype's name ("float32"), or a GGUF file's
    type as llama.cpp reads it ("Q4_1")."""
    return engine.precision


@dataclass(frozen=True)
class Reading:
    """A scorer's head and what it reads, per question asked (`readouts`: its readout or None;
    `reads`: None (no head), False (the state where its options start), True (each option judged
    yes/no: the state where each one's is scored)); the views its readouts read; whether it
    answers alone."""

    head: Head | None
    readouts: tuple[Readout | None, ...]
    reads: tuple[bool | None, ...]
    views: tuple[str, ...]
    alone: bool
    prompt_scores: bool = False

    @classmethod
    def of(cls, task: Any, engine: Any, prompt_scores: bool = False) -> "Reading":
        """The reading of `task`'s spec's head on `engine` (refused in one line, SpecError, when
        the engine's states are not those it was fitted on: width, layers, views)."""
        head, questions = task.spec.head, task.questions
        if head is None:
            return cls(None, (None,) * len(questions), (None,) * len(questions), PLAIN, False, prompt_scores)
        head.check_width(engine.hidden_size, engine.layers)
        head.check_engine(engine.name, precision_of(engine))
        readouts = tuple(head.readout_for(q.id) for q in questions)
        needs = [q.id for q, r in zip(questions, readouts) if r is None or r.reads.logprobs]
        if needs and not prompt_scores:
            log.info("the options are scored: the prompt answers, or its scores feed the head, for %s",
                     ", ".join(repr(q) for q in needs))
        return cls(head, readouts, tuple(head.reads(questions)), head.views, task.spec.head_alone(prompt_scores),
                   prompt_scores)

    def row(self, task: Any, prep: Any) -> tuple[Row, list[int]]:
        """What a forward feeds for `prep` and the candidates whose answer states it reads: the
        head-alone row where the head answers alone, else the item's whole row."""
        if self.alone:
            return alone_row(task, prep, self.reads)
        return prep.row, task.answer_positions(prep, self.reads)

    def forward(self, engine: Any, prefix: Any, task: Any, preps: Sequence[Any], scored: bool,
                reads: Sequence[bool | None] | None = None, views: Sequence[str] | None = None
                ) -> tuple[list[list[float]] | None, list[list[dict[str, np.ndarray]]]]:
        """One forward of `preps` reading, per item and question, the views the head reads (or
        those `reads` and `views` ask for): with `scored`, every option scored to the end beside
        them (each item's options' log-probabilities, its texts combined); else the head-alone
        rows (`alone_row`), no option scored (None)."""
        reads, views = self.reads if reads is None else reads, self.views if views is None else tuple(views)
        made = [(p.row, task.answer_positions(p, reads)) if scored else alone_row(task, p, reads) for p in preps]
        values, states = engine.score_with_states(prefix, [row for row, _ in made], [want for _, want in made],
                                                  probe_of(views))
        split = [self.split(p, found, reads, views) for p, found in zip(preps, states)]
        return ([p.groups.combine(v) for p, v in zip(preps, values)] if scored else None), split

    def answers(self, answers: Answers | Sequence[Question], states: Sequence[Mapping[str, np.ndarray]]) -> Answers:
        """The head's answers: over the prompt's `answers` (the questions it reads decided by it
        from `states`, one entry per question read), or, answering alone, for the questions asked
        (`answers` is then those questions, no option scored)."""
        each = iter(states)
        if not isinstance(answers, Answers):  # alone: every question asked has a readout
            asked = tuple(answers)
            alone: list[Decision | Tags] = []
            novelty: list[float | None] = []
            for q, r in zip(asked, self.readouts, strict=True):
                assert r is not None  # a head answers alone only where it reads every question
                views = next(each)
                alone.append(decided_by(r, q, views, None))
                novelty.append(r.novelty(views))
            return Answers(asked, tuple(alone), tuple(None for _ in asked), tuple(novelty))
        if self.head is None:
            return answers
        decided = list(answers.decisions)
        read: list[float | None] = [None] * len(decided)
        for i, (q, r) in enumerate(zip(answers.questions, self.readouts)):
            if r is not None:
                views = next(each)
                decided[i] = decided_by(r, q, views, answers.logprobs[i])
                read[i] = r.novelty(views)
        return Answers(answers.questions, tuple(decided), answers.logprobs, tuple(read))

    def split(self, prep: Any, found: np.ndarray, reads: Sequence[bool | None] | None = None,
              views: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
        """The states read at `Task.answer_positions` (as the engine gives them for `views`), per
        question read: each view [1, H], or [K, H] where it reads each option's yes/no (a mean over
        the item's tokens is the same for each)."""
        named = _named(found, tuple(views or self.views))
        parts, at = [], 0
        for r, (a, b) in zip(self.reads if reads is None else reads, prep.parts):
            if r is not None:
                n = b - a if r else 1
                parts.append({v: np.repeat(x, n, axis=0) if v.startswith("mean") else x[at: at + n]
                              for v, x in named.items()})
                at += n
        return parts


def alone_row(task: Any, prep: Any, reads: Sequence[bool | None]) -> tuple[Row, list[int]]:
    """The row a head alone feeds for `prep` (its tokens and, per answer position `reads` asks
    for, the candidate's context and first token: no option scored), and its wanted candidates
    (every one)."""
    positions = task.answer_positions(prep, reads)
    cands = list(prep.candidates.values())
    skips = [prep.skips[i] if prep.skips else 0 for i in positions]
    row = Row(prep.row.ids, prep.row.prefix_len, [cands[i][:s + 1] for i, s in zip(positions, skips)],
              skips if prep.skips else ())
    return row, list(range(len(positions)))


def probe_of(views: Sequence[str]) -> Probe | None:
    """What the engine reads for `views` (task/features.py); None: the final state alone."""
    if tuple(views) == PLAIN:
        return None
    f = Features(tuple(views))
    return Probe(f.layers, f.mean)


def _named(found: np.ndarray, views: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The engine's states for a row as views: each answer position's [n, H], a mean [1, H]."""
    probe = probe_of(views)
    if probe is None:
        return {"state": found}
    n = found.shape[0] - (1 if probe.mean else 0)
    out = {}
    for v in views:
        at = probe.layers.index(layer_of(v))
        out[v] = found[n:, at] if v.startswith("mean") else found[:n, at]
    return out
