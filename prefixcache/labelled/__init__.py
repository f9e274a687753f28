"""The labelled-data loop: `prefixcache fit` trains a head on the user's labels and `prefixcache
suggest` picks the items worth labelling next.

- fit.py: `fit(FitOptions)`: checks, the states read, each question's head judged and fitted, the
  head file, the fitted spec and the figures written;
- heads.py: `fit`'s readouts judged against the prompt rule on the same held-out folds, the cut
  certified, the figures and the learning curve (no torch);
- data.py: one question's labelled data (`Labelled`) and a readout's choice (`Choice`);
- readouts.py: the readouts (logistic regressions on hidden states, scikit-learn) and the inner
  cross-validation that chooses C and the features (no torch);
- hygiene.py: what fit refuses or notes of the labelled rows (counts, copies, rows `suggest`
  picked, likely label errors);
- cutpoint.py: where a head abstains (`fit --target-accuracy`, `--coverage`): the cut chosen on
  held-out predictions with an exact binomial bound, in a fixed sequence, and the risk-coverage
  table (no torch);
- passes.py: the labelled items' and the pool's one pass (the torch side): the states, and the
  options' scores where needed;
- states.py: the states a fit read, kept in the cache row by row: an interrupted fit continues;
- picking.py: which unlabelled items to label next, from states and a head's margins (no torch);
- suggest.py: `suggest(SuggestOptions)`: checks, the pool read once, the items picked and written.

May import: run, reports, scoring, model, data, task, compat, errors. Never prints; imported by
cli and api.
"""
