"""prefixcache: classify batches of text with a local causal LM, encoding the static prompt prefix once.

The package is layered; imports flow one way, from the top down:

    cli/       the command line: options, error lines and exit codes, progress, tables
    run/       one run from plan to result: options table, plan, Job, pipeline, shards, bench
    reports/   evaluation and gates, diff, the HTML report
    scoring/   the model at work on a task: prepared items, batches, Scorer, --exact
    model/     models and tokenizers, the engine, the attention kernel, the prefix store
    data/      the input items, the record, the output file
    task/      the spec, the prompt, the decision rule
    compat.py, errors.py: the ground every layer stands on

    api/       prefixcache from Python: Classifier (DataFrames, Arrow, datasets); ray.py for Ray Data

Each folder's docstring says what it owns and what it may import.

From Python:

    from prefixcache import Classifier
    clf = Classifier("configs/support-tickets.yaml")
    records = list(clf.classify(["I was charged twice"]))
"""

__version__ = "0.1.0"
__all__ = ["Classifier"]


def __getattr__(name: str):  # the API's imports load only when it is asked for
    if name == "Classifier":
        from .api.classifier import Classifier

        return Classifier
    raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
