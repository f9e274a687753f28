"""One run, from plan to result.

- options.py: `RunOptions`, the table of everything a run takes (and how each is written on the
  command line);
- plan.py: every check that needs no model, and the `Plan` that carries what it settled;
- job.py: `Job`, whose methods are a run's phases, and `RunResult`;
- pipeline.py: `classify`: items -> batches -> scores -> records, in input order;
- shards.py: splitting one job into shards and joining their outputs (`merge`, launches);
- review.py: `run --review`: the abstained items, with the top guesses, for a person to label;
- labelled.py: the reader of labelled files (tune, fit, suggest), every item checked against the specs;
- dryrun.py, bench.py: `run --dry-run` and `prefixcache bench` (its modes timed);
- benchjob.py: `prefixcache bench` as one job (items read, the scorer built, the modes or the
  precisions timed), which the CLI prints.

May import: reports, scoring, model, data, task, compat, errors. Never prints; imported by cli.
"""
