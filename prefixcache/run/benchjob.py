"""`prefixcache bench` as one job: the spec read and checked, the items read (as many as the
naive modes and the cached modes need), the task and scorer built once, then every mode timed
(run/bench.py) or, with `--exact`, float32, the low precision and the checked pair side by side.
A spec with a fitted head has its prompt scoring timed in every mode and its head-alone pipeline
timed apart. The CLI only prints what it returns.

Example:
    report = bench_job(RunOptions("configs/support-tickets.yaml", "data/samples/tickets.jsonl"), limit=8)
    print(report.to_json())
"""

from __future__ import annotations

import dataclasses
from itertools import islice
from typing import Callable, Optional

from .. import compat
from ..errors import OutputError
from ..scoring.build import build_on, build_scorer
from ..scoring.prepare import Batching, Task
from ..scoring.scorer import Scorer
from .bench import BenchReport, PrecisionReport, Step, bench_exact, run_bench
from .options import RunOptions, bench_sizes
from .plan import load_options_spec, read_options_items


def bench_job(options: RunOptions, limit: Optional[int] = None, max_items: Optional[int] = None,
              step: Step = lambda what: None, note: Callable[[str], None] = lambda line: None
              ) -> BenchReport | PrecisionReport:
    """Every mode timed on the same items (`limit`: the naive modes' items, `max_items`: the
    cached modes'; None: as `bench_sizes` says). `step` is told what is measured now, `note`
    what a user should know of the comparison (a line each). Raises OutputError for no items."""
    task_spec = fitted = load_options_spec(options)
    if task_spec.head is not None:  # the modes compare label scores; a head of the state alone is timed apart
        note("bench: timing the spec's prompt scoring (every option) in every mode, its labels compared as the "
             "prompt decides them; then the run pipeline with the fitted head, when it answers alone")
        task_spec = dataclasses.replace(task_spec, head=None)
    naive, cached = bench_sizes(task_spec, limit, max_items)
    records = list(islice(read_options_items(options, task_spec), cached))
    if not records:
        raise OutputError(f"{options.items}: no items to benchmark")
    compat.quiet_libraries()
    task = Task.from_spec(task_spec, options.cache_dir)
    batching = Batching(options.batch_size, options.batch_tokens)  # bench times pruned scoring on its own
    if options.exact:
        return bench_exact(task, records, options.scoring(), batching, step)
    step("loading the model")  # its prefix prefilled here (bench times that), every label scored: pruning is timed apart
    scorer = build_scorer(task, options.scoring(prune="off", cache_store=False))
    step(f"timing {len(records)} items, the naive modes on {min(naive, len(records))}"
         + (" (--max-items and --limit change that)" if limit is None or max_items is None else ""))
    head = _head(task.with_spec(fitted), scorer, options, note) if fitted.head is not None else None
    return run_bench(scorer, records, min(naive, len(records)), batching, step, estimate_slow=limit is None, head=head)


def _head(task: Task, scorer: Scorer, options: RunOptions, note: Callable[[str], None]) -> Scorer:
    """The fitted spec's scorer on the bench's engine: its head-alone pipeline is timed too."""
    head = build_on(task, scorer.engine, options.scoring(cache_store=False))
    if not head.head_only:
        note("bench: the fitted head reads the options' scores too, so it costs what the prompt scoring costs")
    return head
