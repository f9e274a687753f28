"""Building a task's scorer whole: `ScoringOptions` (what every entry point may choose about
scoring) and `build_scorer`, the one place a scorer is made for `run`, `tune`, `bench`,
`render`, `Classifier` and Ray.

The scorer's contract (`scorer.ItemScorer`), as a pipeline uses it:

- `score(preps)`: each prepared item's candidate log-probs (summed over a candidate's tokens,
  forms combined), in candidate order; equal, to float rounding, to re-encoding the whole prompt
  and candidate (`model/reference.py`). Pruned label scoring returns some values as upper
  bounds and says which (`task/decision.Bounded`).
- `decide(prep, logprobs)`: the decision the spec asks for (normalisation, calibration,
  threshold; tags for multi-label).
- `context`: the model's limit on positions, `precision(key)`: what produced a prompt's
  scores when records say so, `rescoring()`: what --exact re-scored.

Whether labels are pruned is decided here, once, from the spec and the options
(`TaskSpec.prunes`), and never changed after the scorer is built (`bench`, which times both,
builds its scorer unpruned and switches it on purpose).

Example:
    task = Task.from_spec(spec, options.cache_dir)
    scorer = build_scorer(task, ScoringOptions.from_environment(device="cpu"))
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .. import compat
from ..model.load import pick_device
from ..model.store import PrefixStore, cache_root, store_max_bytes
from .prepare import Task
from .scorer import ItemScorer, Scorer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoringOptions:
    """What an entry point may choose about scoring; `run`'s options carry the same values.

    Attributes:
        cache_dir: converted models and stored prefixes.
        device, dtype: "auto" (CUDA when present, float32 on the CPU) or a name.
        exact: --exact: low precision with close calls scored again in float32.
        prune: "auto", "on" or "off" (--prune).
        cache_store: keep and reuse prefilled prefixes in the prefix store.
        store_max_bytes: the prefix store's bound (None: its default).
    """

    cache_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    exact: bool = False
    prune: str = "auto"
    cache_store: bool = True
    store_max_bytes: Optional[int] = None

    @classmethod
    def from_environment(cls, cache_dir: Union[str, Path, None] = None, **given) -> "ScoringOptions":
        """Options as the command line reads them: `cache_dir` (else PREFIXCACHE_CACHE_DIR, else
        ~/.cache/prefixcache) and PREFIXCACHE_STORE_MAX_MB, with `given` set over them."""
        given.setdefault("store_max_bytes", store_max_bytes())
        return cls(cache_root(cache_dir), **given)

    def replace(self, **changes) -> "ScoringOptions":
        return dataclasses.replace(self, **changes)


def build_scorer(task: Task, options: ScoringOptions) -> ItemScorer:
    """The task's scorer, whole: its model loaded, its prefix from the prefix store when kept
    there (else prefilled and kept), pruning decided. With `exact`, a low-precision scorer whose
    close calls a float32 twin scores again (float32 alone on hardware without bfloat16 matrix
    instructions, where that would gain nothing)."""
    from .exact import CheckedScorer

    store = None
    if options.cache_store:
        root = options.cache_dir / "prefixes"
        store = PrefixStore(root) if options.store_max_bytes is None else PrefixStore(root, options.store_max_bytes)
    device = pick_device(options.device)
    if options.exact and not compat.bf16_matmul(device):
        log.warning("this %s has no bfloat16 matrix instructions, so --exact would gain nothing: scoring in float32",
                    device)
        scorer: ItemScorer = Scorer.load(task, options.cache_dir, options.device, "float32", store,
                                         says_precision=True)
    elif options.exact:
        scorer = CheckedScorer.pair(task, options.cache_dir, options.device, options.dtype, store)
    else:
        scorer = Scorer.load(task, options.cache_dir, options.device, options.dtype, store)
    scorer.prune(options.prune, options.exact)
    return scorer
