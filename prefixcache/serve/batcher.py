"""A decider run in one worker thread (`Batcher`): callers from any thread (the server's event
loop) submit asks and get futures; asks that arrive within `wait` seconds of each other, up to
`size`, are decided in one pass, cheapest first within a token budget, none starved. Identical
asks share one job; a job no caller waits for any more is dropped. The model never runs on the
caller's thread.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .decider import Ask, Decided, Decider, Ready, check_size
from .defaults import AGE, BATCH_WAIT_MS, MAX_BATCH, PASS_SECONDS, PASS_TOKENS, RECENT, RECENT_S
from .errors import TooLarge

log = logging.getLogger(__name__)


class Abandoned(Exception):
    """Every client waiting for an ask hung up before its pass: it was not computed."""


class ShuttingDown(Exception):
    """The server stopped before this ask's turn (its drain deadline came): answered 503."""


_arrivals = itertools.count()  # the order requests arrived in


@dataclass
class _Job:
    ask: Ask
    key: str  # the ask as canonical JSON: identical asks share one job
    future: Future = field(default_factory=Future)
    waiters: int = 1  # callers waiting for it; none left: abandoned, dropped from the queue
    number: int = field(default_factory=lambda: next(_arrivals))  # arrival order
    ready: Ready | Exception | None = None  # made ready to score (or refused) by the decider, once
    skipped: int = 0  # passes it was left out of for cheaper requests

    @property
    def cost(self) -> int:
        """Tokens it costs a pass (0: refused before scoring, it takes no room)."""
        return self.ready.cost if isinstance(self.ready, Ready) else 0




def ask_key(ask: Ask) -> str:
    """An ask as canonical JSON: two requests with the same instructions, state and questions are one."""
    return json.dumps([ask.instructions, ask.state, ask.questions], ensure_ascii=False, sort_keys=True, default=str)


class Batcher:
    """A decider in one worker thread, deciding the asks that arrive together in one pass:
    `submit` returns a future. A pass takes the asks queued, up to `size` and about `tokens`
    tokens to score (once passes were timed, only as many as take about `seconds`), the cheapest first (one passed over AGE times goes first; an ask refused
    before scoring is answered at once); under load (the last pass took several, or more are
    queued) it first waits up to `wait` seconds for the clients just answered to send again, so
    that they share the next pass; a lone client never waits. A pass that fails is tried again
    request by request, so that one request's failure is its own.

    An ask identical to one queued or in a pass waits for that one (a client retrying after its
    timeout is not computed twice), and one answered within `recent_s` seconds is answered again
    from memory (at most `recent` of them kept). An ask whose every caller `abandon`s it before its
    pass (a client that hung up) is dropped, never computed. `passes`, `computed`, `shared` and
    `dropped` count what happened; `waiting` is what is queued or in a pass."""

    def __init__(self, decider: Decider | Callable[[], Decider], wait: float = BATCH_WAIT_MS / 1000,
                 size: int = MAX_BATCH, recent: int = RECENT, recent_s: float = RECENT_S, tokens: int = PASS_TOKENS,
                 seconds: float = PASS_SECONDS):
        self.wait, self.size, self.tokens, self.seconds = wait, size, tokens, seconds
        self.per_token: float | None = None  # seconds a token of a pass took, a running mean of the passes timed
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._last = 0  # asks in the last pass
        self._lock = threading.Lock()  # guards the jobs below, taken by callers and the worker
        self._waiting: dict[str, _Job] = {}  # queued or in a pass, by key
        self._recent: OrderedDict[str, tuple[float, Decided]] = OrderedDict()  # answered, by key
        self.max_recent, self.recent_s = recent, recent_s
        self.passes = self.computed = self.shared = self.dropped = 0
        self._built = threading.Event()
        self._failed: BaseException | None = None
        self._draining = False
        self._thread = threading.Thread(target=self._run, args=(decider,), name="prefixcache-model", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._failed is not None:
            raise self._failed

    def _build(self, decider: Decider | Callable[[], Decider]) -> bool:
        """The decider, made in this worker thread when given as a function. Made there, the model
        is loaded and warmed up on the thread that runs it, and no other thread ever starts a team
        of OpenMP threads: with two teams on two cores, OpenMP stops spinning between parallel
        regions, and a request took 280 ms where 190 ms on one team (measured, embedded model)."""
        try:
            self.decider = decider() if callable(decider) else decider
        except BaseException as exc:  # noqa: BLE001 - told to the constructor's caller
            self._failed = exc
        self._built.set()
        return self._failed is None

    def submit(self, ask: Ask) -> Future:
        """A future of the ask's answer; one too large to score is refused at once (never queued)."""
        try:
            check_size(ask, self.decider.max_tokens)
        except TooLarge as exc:
            refused: Future = Future()
            refused.set_exception(exc)
            return refused
        key = ask_key(ask)
        with self._lock:
            done = self._recent.get(key)
            if done is not None and time.monotonic() - done[0] <= self.recent_s:
                self.shared += 1
                answered: Future = Future()
                answered.set_result(done[1])
                return answered
            job = self._waiting.get(key)
            if job is not None:
                job.waiters += 1
                self.shared += 1
                return job.future
            job = self._waiting[key] = _Job(ask, key)
        self._queue.put(job)
        return job.future

    @property
    def waiting(self) -> int:
        """Asks queued or in a pass."""
        return len(self._waiting)

    def abandon(self, future: Future) -> None:
        """A caller of `submit` no longer waits for `future` (its client hung up)."""
        with self._lock:
            job = next((j for j in self._waiting.values() if j.future is future), None)
            if job is not None:
                job.waiters -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Finish the asks queued, then stop the worker; with `timeout`, wait at most that long
        (a pass still running is left to the process's exit). Returns whether the worker stopped."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def drain(self) -> int:
        """Answer every ask not answered yet, queued or in a pass, with ShuttingDown (a stop's
        deadline has come); the worker takes no more. Returns how many were so answered."""
        self._draining = True
        with self._lock:
            jobs = [j for j in self._waiting.values() if not j.future.done()]
        for job in jobs:
            _settle(job.future, ShuttingDown())
        return len(jobs)

    def _run(self, decider: Decider | Callable[[], Decider]) -> None:
        if not self._build(decider):
            return
        pending: list[_Job] = []  # taken from the queue, not answered yet: the cheapest go first
        stop = False
        while pending or not stop:
            if not stop:
                new, stop = self._collect(wait=not pending)
                pending += new
            pending = self._live(pending)
            if self._draining:  # answered by `drain`: none is computed any more
                pending = []
            if pending:
                taken, pending = self._take(pending)
                self._last = len(taken)
                self._answer(taken)

    def _collect(self, wait: bool) -> tuple[list[_Job], bool]:
        """Jobs from the queue, and whether `close` was asked. With nothing pending, wait for one;
        under load (the last pass answered several asks) then wait for the others to come back."""
        jobs: list[_Job] = []
        if wait:
            job = self._queue.get()
            if job is None:
                return jobs, True
            jobs.append(job)
        waited = self.wait if wait and (self._last > 1 or not self._queue.empty()) else 0.0
        deadline = time.monotonic() + waited
        while len(jobs) < self.size:
            try:
                more = self._queue.get(timeout=max(0.0, deadline - time.monotonic())) if waited else \
                    self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return jobs, True
            jobs.append(more)
        return jobs, False

    def _take(self, pending: list[_Job]) -> tuple[list[_Job], list[_Job]]:
        """The jobs of the next pass, and those left for later: requests refused before scoring
        (too costly, a bad pack) at once; then the cheapest first, up to `tokens` (at least one
        request, at most `size`), except that one passed over AGE times goes first. So a light
        request waits for at most one bounded pass, and a heavy one is not starved."""
        fresh = [j for j in pending if j.ready is None]
        for job, ready in zip(fresh, self.decider.ready([j.ask for j in fresh]) if fresh else ()):
            job.ready = ready
        order = sorted(pending, key=lambda j: (j.skipped < AGE, j.cost))
        taken: list[_Job] = []
        left: list[_Job] = []
        spent, budget = 0, self.budget
        for job in order:
            if job.cost == 0 or (len(taken) < self.size and (not spent or spent + job.cost <= budget)):
                taken.append(job)
                spent += job.cost
            else:
                job.skipped += 1
                left.append(job)
        return taken, sorted(left, key=lambda j: j.number)

    @property
    def budget(self) -> int:
        """Tokens a pass takes at most (beyond its first request): `tokens`, and once passes were
        timed, as many as take about `seconds`, so that a light request waits for at most one
        pass of about that long (or one heavy request alone) and shares no longer one."""
        if self.per_token is None:
            return self.tokens
        return max(1, min(self.tokens, int(self.seconds / self.per_token)))

    def _timed(self, jobs: Sequence[_Job], seconds: float) -> None:
        tokens = sum(j.cost for j in jobs)
        if tokens:
            rate = seconds / tokens
            self.per_token = rate if self.per_token is None else 0.7 * self.per_token + 0.3 * rate

    def _live(self, jobs: list[_Job]) -> list[_Job]:
        """The jobs someone still waits for; the others are dropped, their futures told why."""
        with self._lock:
            gone = [j for j in jobs if j.waiters <= 0]
            for job in gone:
                del self._waiting[job.key]
            self.dropped += len(gone)
        for job in gone:
            _settle(job.future, Abandoned())
        return [j for j in jobs if j.waiters > 0]

    def _answer(self, jobs: list[_Job]) -> None:
        """Settle the jobs of a pass: those refused before scoring with their error, the others
        with their answers from one pass; when that pass fails, each is tried alone, so that one
        request's failure is its own."""
        scored = [j for j in jobs if isinstance(j.ready, Ready)]
        results: dict[int, Any] = {id(j): j.ready for j in jobs if not isinstance(j.ready, Ready)}
        try:
            start = time.perf_counter()
            ready = [j.ready for j in scored if isinstance(j.ready, Ready)]  # (all of them)
            results.update(zip(map(id, scored), self.decider.decide_ready(ready) if scored else ()))
            self._timed(scored, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - the pass failed: each of its requests is tried alone
            if len(scored) == 1:
                log.exception("deciding a request failed")
                results[id(scored[0])] = exc
            else:
                for job in scored:
                    self._answer([job])  # settles it (and logs its failure, if it fails alone)
                scored, jobs = [], [j for j in jobs if not isinstance(j.ready, Ready)]
        with self._lock:
            self.passes += bool(scored)
            self.computed += len(scored)
            now = time.monotonic()
            for job in jobs:
                del self._waiting[job.key]
                if isinstance(results[id(job)], Decided):
                    self._recent[job.key] = (now, results[id(job)])
                    self._recent.move_to_end(job.key)
            while len(self._recent) > self.max_recent:
                self._recent.popitem(last=False)
        for job in jobs:
            _settle(job.future, results[id(job)])


_SETTLING = threading.Lock()  # the worker and a drain may settle the same future: the first one wins


def _settle(future: Future, result: Any) -> None:
    """Give a future its result or exception, unless it was cancelled or settled already: the
    worker never dies of it."""
    with _SETTLING:
        if future.done() or not future.set_running_or_notify_cancel():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
