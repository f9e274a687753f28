"""Ray Data: prefixcache over many machines, one model per actor.

    import ray
    import prefixcache.ray  # this module

    ds = ray.data.read_parquet("items.parquet")
    out = ds.map_batches(prefixcache.ray.Classify, fn_constructor_kwargs={"spec": "spec.yaml"},
                         compute=ray.data.ActorPoolStrategy(size=4), batch_size=256, batch_format="pandas")
    out.write_parquet("predictions/")

Each actor builds one `Classifier` (the model loaded once, the prefix from the prefix store when
`cache_dir` is shared) and adds the prediction columns to every batch. With Ray Data's row-level
checkpoint (`DataContext.checkpoint_config`), a job resumed after its spec, model, engine or
precision changed is refused as `run --resume` refuses it (scoring/raycheckpoint.py). Ray is an
optional extra (`pip install 'prefixcache[ray]'`); this module does not import it.
"""

from __future__ import annotations

from typing import Any

from .classifier import Classifier, SpecLike
from ..scoring.raycheckpoint import check_resumed_job, task_fingerprint


class Classify:
    """A callable class for `Dataset.map_batches`: `Classifier(**kwargs)` once per actor, then
    each batch (a pandas DataFrame, a pyarrow Table, or a dict of columns) with its predictions."""

    def __init__(self, spec: SpecLike = None, **kwargs: Any):
        kwargs.setdefault("progress", False)  # actors' stderr is a log, not a terminal
        self.classifier = Classifier(spec, **kwargs)
        scorer = self.classifier.scorer
        check_resumed_job(task_fingerprint(scorer.task, scorer.engine, scorer.dtype, exact=self.classifier.exact,
                                           prune=self.classifier.options.prune))

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            return self.classifier.batch_fn({k: list(v) for k, v in batch.items()})
        return self.classifier.classify_df(batch)
