"""prefixcache from Python: the library's face, built on the same entry points as the command line.

- classifier.py: `Classifier` (notebooks, scripts, DataFrames, Arrow tables, `datasets`): a spec's
  scorer built once (scoring/build.py) and items through `run`'s pipeline;
- tables.py: DataFrames, Arrow tables and column dicts in, prediction columns out;
- progress.py: a bar on long calls (Rich in a terminal, tqdm in a notebook);
- ray.py: the Ray Data recipe, `Classify` (imported as `prefixcache.ray`).

May import: run (only its public entry points: `run.pipeline.classify` and `RunStats`), reports,
scoring, model, data, task, compat, errors. Nothing below imports it; the command line does not
need it.
"""
