"""`prefixcache tune` and `prefixcache fit`: choosing the prompt and the decision rule, or training a
head, on labelled items, honestly.

- variants.py: the prompt variants and models compared (no torch);
- rules.py: decision rules, and what they decide as arrays over the items (no torch);
- selection.py: held-out judging (cross-validation or a test file), bootstrap intervals, the
  verdict (no torch);
- passes.py: each variant's one scoring pass over the items (the torch side);
- tuned.py: the chosen spec, written with the user's comments kept;
- leaderboard.py: the findings as words, JSON and Markdown (no torch);
- job.py: `tune(TuneOptions)` from checks to `TuneResult`;
- heads.py: `fit`'s readouts (logistic regressions on hidden states, scikit-learn) judged against
  the prompt rule on the same held-out folds (no torch);
- cutpoint.py: where a head abstains (`fit --target-accuracy`, `--coverage`): the cut chosen on
  held-out predictions with an exact binomial bound, in a fixed sequence, and the risk-coverage
  table (no torch);
- fit.py: `fit(FitOptions)`: checks, the states read, each question's head judged and fitted, the
  head file, the fitted spec and the figures written;
- states.py: the states a fit read, kept in the cache a batch a file: an interrupted fit continues;
- picking.py: which unlabelled items to label next, from states and a head's margins (no torch);
- suggest.py: `suggest(SuggestOptions)`: checks, the pool read once, the items picked and written.

May import: run, reports, scoring, model, data, task, compat, errors. Never prints; imported by cli.
"""

from .job import TuneOptions, TuneResult, plan_tune, tune

__all__ = ["TuneOptions", "TuneResult", "plan_tune", "tune"]
