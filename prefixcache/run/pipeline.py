"""The classification pipeline: items -> batches -> scores against the cached prefix -> records,
in input order. It never prints; progress goes through a callback.

Example:
    stats = RunStats()
    for record in classify(scorer, read_items("items.jsonl"), Batching(), stats):
        ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

from ..data.items import Item
from ..data.records import Keep, Record, error_record, id_text, logprobs_in_order, make_record
from ..task.decision import Bounded
from ..scoring.prepare import Batching, Failed, Prepared

if TYPE_CHECKING:  # the scorer brings torch; this module only calls it
    from ..scoring.scorer import ItemScorer


@dataclass
class RunStats:
    items: int = 0  # records yielded (error records included)
    seconds: float = 0.0  # scoring time, prefill excluded
    scored: int = 0  # distinct prompts run through the model (duplicates reuse their scores)
    errors: int = 0  # items yielded as error records (on_error="skip")
    item_tokens: int = 0  # tokens of the scored items' own (not cached) part

    @property
    def ms_per_item(self) -> float:
        return 1000 * self.seconds / self.items if self.items else 0.0

    @property
    def items_per_second(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0


def classify(
    scorer: ItemScorer,
    items: Iterable[Item],
    batching: Batching = Batching(),
    stats: RunStats | None = None,
    done: Mapping[str, Record] | None = None,
    on_batch: Callable[[int], None] | None = None,
    keep: Keep = (),
) -> Iterator[Record]:
    """Score items in batches against the cached prefix; yield records in input order.

    Items whose prompt and candidates were scored recently reuse those scores. Items whose id is
    in `done` (records an earlier run wrote, by `record_id`) are not yielded again; their batches
    are replayed so that every other record is the same as in an uninterrupted run. With
    on_error="skip", an item that cannot be scored yields an error record. `on_batch(n)` follows
    each batch's n records; `keep` names the input fields each record carries (None: all)."""
    task = scorer.task
    stats = stats if stats is not None else RunStats()
    done = done or {}
    for batch in task.batches(items, batching, scorer.context):
        start = time.perf_counter()
        preps = [p for p in batch if isinstance(p, Prepared)]
        if task.spec.normalize == "pmi" and task.spec.choices:
            scorer.score_unconditional([c for p in preps for c in p.candidates.values()])
        replay = bool(preps) and all(id_text(p.item.id) in done for p in preps)
        known: dict[tuple, list[float]] | None = None
        if replay:  # every item of this batch is written: its scores are in the records
            found = {p.key: logprobs_in_order(done[id_text(p.item.id)], p.texts, task.spec) for p in preps}
            known = {key: lps for key, lps in found.items() if lps is not None}
            if len(known) < len(found):
                known = None  # not all in the records: scored again
        scores = scorer.score(preps, known)
        pending = [entry for entry in batch if id_text(entry.item.id) not in done]
        if not pending:
            continue
        elapsed = time.perf_counter() - start
        stats.seconds += elapsed
        stats.items += len(pending)
        stats.scored += len(scores.computed)
        stats.item_tokens += sum(p.own_tokens for p in scores.computed)
        by_key = {p.key: lps for p, lps in zip(preps, scores.logprobs)}
        ms = 1000 * elapsed / len(pending)
        for entry in pending:
            yield _record(scorer, entry, by_key, ms, stats, keep)
        if on_batch:
            on_batch(len(pending))


def _record(scorer: ItemScorer, entry: Prepared | Failed, by_key: Mapping[tuple, list[float] | None], ms: float,
            stats: RunStats, keep: Keep) -> Record:
    if isinstance(entry, Failed):
        stats.errors += 1
        return error_record(entry.item, entry.message, scorer.task.spec.id_field, keep)
    logprobs = by_key[entry.key]
    pruned = None
    if scorer.says_pruned:  # which options pruned scoring left at their bound
        pruned = logprobs.pruned if isinstance(logprobs, Bounded) else ()
    return make_record(scorer.task.spec, entry.item, scorer.decide(entry, logprobs), entry.enc.prefix_len,
                       entry.own_tokens, ms, keep, scorer.precision(entry.key), pruned)
