"""Ray Data: `decide` over many machines, one model per actor.

    import ray
    import prefixcache.ray

    ds = ray.data.read_text("requests.jsonl")  # one request body a row, in the column "text"
    out = ds.map_batches(prefixcache.ray.Decide, fn_constructor_kwargs={"model": None},
                         compute=ray.data.ActorPoolStrategy(size=4), batch_size=64, batch_format="pandas")
    out.write_json("responses/")

Each actor builds one `Decider` (the model loaded once, the instructions' prefixes from the prefix
store when `cache_dir` is shared) and adds to every row what `decide` writes for its line:
`custom_id`, `request_sha`, `status_code` and `body` (the answer, or the error in the request's
format, as JSON text). With Ray Data's row-level checkpoint, a job resumed after its model, engine,
precision or heads changed is refused (scoring/raycheckpoint.py). This module does not import Ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ..scoring.bounds import engine_parts
from ..scoring.raycheckpoint import check_resumed_job
from ..errors import InputError
from ..model.load import model_content_identity
from ..scoring.options import ScoringOptions
from ..task.head import load_head
from .decider import Decider
from .defaults import MAX_BATCH
from .replay import answer_lines, request_digest

ADDED = ("custom_id", "request_sha", "status_code", "body")


class Decide:
    """A callable class for `Dataset.map_batches`: one `Decider` per actor, then each batch (a
    pandas DataFrame or a dict of columns) with the responses to the requests in `column` (JSON
    text, or already-parsed objects), decided `batch_size` requests to a forward pass."""

    def __init__(self, model: Optional[str] = None, *, column: str = "text", batch_size: int = MAX_BATCH,
                 device: str = "auto", dtype: str = "auto", cache_dir: Optional[Union[str, Path]] = None,
                 heads: Sequence[Union[str, Path]] = ()):
        if batch_size < 1:
            raise InputError(f"batch_size must be 1 or more, not {batch_size}")
        self.decider = Decider(model, ScoringOptions.from_environment(cache_dir, device=device, dtype=dtype),
                               heads=[load_head(str(h), Path("heads")) for h in heads])
        self.column, self.batch_size = column, batch_size
        engine = self.decider.engine
        check_resumed_job({"model": model_content_identity(self.decider.base.source, self.decider.options.cache_dir),
                           **engine_parts(engine, engine.precision),
                           "heads": sorted(h.digest for h in self.decider.heads)})

    def __call__(self, batch: Any) -> Any:
        frame = not isinstance(batch, dict)
        columns = list(batch.columns) if frame else list(batch)
        if self.column not in columns:
            raise InputError(f"the batch has no column {self.column!r} of requests (it has: {', '.join(map(str, columns))})")
        taken = [name for name in ADDED if name in columns and name != self.column]
        if taken:
            raise InputError(f"the batch already has column {taken[0]!r}, which the responses fill")
        lines = [value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                 for value in list(batch[self.column])]
        out: dict[str, list[Any]] = {name: [] for name in ADDED}
        for at in range(0, len(lines), self.batch_size):
            chunk = lines[at: at + self.batch_size]
            for line, (custom_id, status, body) in zip(chunk, answer_lines(self.decider, chunk)):
                out["custom_id"].append(None if custom_id is None else str(custom_id))
                out["request_sha"].append(request_digest(line))
                out["status_code"].append(status)
                out["body"].append(json.dumps(body, ensure_ascii=False))
        if frame:
            return batch.assign(**out)
        return {**{name: list(batch[name]) for name in columns}, **out}
