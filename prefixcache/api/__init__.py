"""prefixcache from Python: `Classifier` (notebooks, scripts, DataFrames, Arrow tables, `datasets`)
and the Ray Data recipe (`prefixcache.ray`).

May import: run, reports, scoring, model, data, task, compat, errors. Nothing below imports it;
the command line does not need it.
"""
