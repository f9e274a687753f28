"""The model at work on a task: items prepared, batched and scored against the cached prefix.

- prepare.py: `Task` (a spec with its model's tokenizer): items into prompt ids and candidates
  (`Prepared`), and into batches that never depend on timing;
- scorer.py: `Scorer`: the engine and the prefilled prefix of one task; scores batches, reuses
  duplicates' scores, and decides (normalisation, calibration, PMI) through task/decision.py;
- reading.py: `Reading`: what a scorer's fitted head reads of each forward (views, answer
  positions, the engine's probe) and whether it answers alone, fixed when the scorer is built;
- exact.py: `CheckedScorer` (--exact): a low-precision scorer whose close calls are scored again
  in float32, by a gap bound measured on the input's first items;
- bounds.py: the bounds --exact measured, kept in the cache by model, precision, engine and task;
- pruning.py: pruned label scoring, the argmax of many labels at the cost of a few, exactly;
- options.py: `ScoringOptions`, what every entry point may choose about scoring (no torch);
- build.py: `build_scorer`, the one place a scorer is built whole (model, prefix, pruning), and
  the scorer's contract;
- raycheckpoint.py: what answers, kept in a Ray Data job's checkpoint folder, so that a job
  resumed after it changed is refused (Ray's actors: api/ray.py, serve/raydata.py).

May import: model, data (items), task, compat, errors. Imported by run, tune, api, serve and cli.
"""
