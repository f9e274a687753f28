"""`run --dry-run`: what a run would do, counted and timed, with nothing written."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any, Iterator, Optional

from ..data.items import Item
from ..model.rows import trie
from ..scoring.prepare import Prepared, Task
from ..task.spec import TaskSpec
from .job import Event, Progress, load_scorer, output_start
from .options import RunOptions
from .pipeline import RunStats, classify
from .plan import make_plan


@dataclass
class DryRun:
    """What a run would do, measured without writing anything."""

    prefix_tokens: int
    items: list[dict[str, Any]]  # per item: id, item_tokens (its own, after the cached prefix), label_tokens
    failed: int  # items that could not be scored (with on_error="skip")
    measured: int  # items scored to time the run
    ms_per_item: float
    load_seconds: float
    pruning: str = ""  # what --prune does on this task, in words ("": it does not apply)
    head_alone: bool = False  # a fitted head answers alone: the label tokens are one a position it reads
    written: int = 0  # --resume: items the output holds already (not counted above)
    continued: str = ""  # --resume/--update: how the output would be continued ("resume", "grown", "update")

    @property
    def item_tokens(self) -> int:
        return sum(i["item_tokens"] for i in self.items)

    @property
    def label_tokens(self) -> int:
        return sum(i["label_tokens"] for i in self.items)

    @property
    def estimate_seconds(self) -> float:
        return self.ms_per_item * len(self.items) / 1000


def dry_run(options: RunOptions, measure: int = 16, progress: Optional[Progress] = None) -> DryRun:
    """Check the spec and the input, count every item's tokens, and time the first `measure`
    items through the model (nothing is written)."""
    plan = make_plan(options)
    begun = output_start(plan, plan.fingerprint()) if (options.resume or options.update) else None
    skip = len(begun.done) if begun is not None and begun.appends else 0  # as the run: after the records written
    if progress:
        progress(Event("checked", total=plan.total))
        progress(Event("loading", detail="tokenizer"))
    task = Task.from_spec(plan.spec, options.cache_dir)
    items, failed = [], 0
    first: list[Item] = []
    reads = task.spec.head.reads(task.questions) if task.spec.head is not None else None
    last = plan.total if plan.total is not None else options.limit
    read: Iterator[Item] = islice(plan.read_input(), skip, last)
    if plan.stream:  # read once: keep the first items for the timing
        read = _keeping(read, first, measure)
    for batch in task.batches(read, plan.batching):
        for entry in batch:
            if not isinstance(entry, Prepared):
                failed += 1
                continue
            items.append({"id": entry.item.id, "item_tokens": entry.own_tokens,
                          "label_tokens": len(trie(list(entry.candidates.values()))),
                          **({"head_tokens": _head_tokens(task, entry, reads)} if reads else {})})
    if progress:
        progress(Event("loading", detail="model"))
    scorer = load_scorer(task, plan)
    stats = RunStats()
    count = min(measure, len(items)) if items else 0
    sample = first[:count] if plan.stream else islice(plan.read_input(), skip, skip + count)
    for _ in classify(scorer, sample, plan.batching, stats):
        pass
    alone = bool(getattr(scorer, "head_only", False))
    for item in items:  # what goes through the model after the item: its options, or one token an answer
        spent = item.pop("head_tokens", None)
        item["label_tokens"] = spent if alone else item["label_tokens"]
    return DryRun(len(scorer.prefix.ids), items, failed, stats.items, stats.ms_per_item,
                  task.load_seconds + scorer.load_seconds, _pruning_words(plan.spec, plan.options.prune, scorer.pruning),
                  alone, skip, begun.mode if begun is not None else "")


def _head_tokens(task: Task, prep: Prepared, reads: list[bool | None]) -> int:
    """The tokens a head answering alone feeds after the item: per answer position it reads, the
    candidate's context (a question's text) and its first token."""
    return sum((prep.skips[c] if prep.skips else 0) + 1 for c in task.answer_positions(prep, reads))


def _pruning_words(spec: TaskSpec, mode: str, pruned: bool) -> str:
    """What --prune does on this task, for the dry run's summary."""
    if pruned:
        return (f"labels pruned (--prune {mode}; the label tokens above are those of scoring every label, the time "
                f"is measured pruned)")
    if spec.prunes("on") and mode == "auto" and len(spec.labels) >= MANY_LABELS:
        return ("every label scored to the end (--prune on would stop scoring the labels that cannot win; bench "
                "says how much faster that is with this model)")
    return ""


MANY_LABELS = 10  # labels from which the dry run mentions --prune on


def _keeping(items: Iterator[Item], kept: list[Item], n: int) -> Iterator[Item]:
    """`items`, keeping the first `n` of them in `kept` as they pass."""
    for item in items:
        if len(kept) < n:
            kept.append(item)
        yield item
