"""`prefixcache tune`: choosing the prompt and the decision rule on labelled items, honestly.

- variants.py: the prompt variants and models compared (no torch);
- rules.py: decision rules, and what they decide as arrays over the items (no torch);
- selection.py: held-out judging (cross-validation or a test file), the tuned figure, the verdict
  (no torch; the folds and intervals are reports/resampling.py's);
- passes.py: each variant's one scoring pass over the items (the torch side);
- leaderboard.py: the findings as words, JSON and Markdown (no torch);
- job.py: `tune(TuneOptions)` from checks to `TuneResult`.

The labelled-data loop (`fit`, `suggest`) is labelled/'s.

May import: run, reports, scoring, model, data, task, compat, errors. Never prints; imported by cli.
"""

from .job import TuneOptions, TuneResult, plan_tune, tune

__all__ = ["TuneOptions", "TuneResult", "plan_tune", "tune"]
