"""Building a task's scorer whole, from `ScoringOptions` (options.py): `build_scorer` and
`build_on`, the one place a scorer is made for `run`, `tune`, `bench`, `Classifier` and Ray.

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

import logging

from ..errors import UsageError
from .options import exact_refusal
from ..model.cache import prefixes_dir
from ..model.protocol import PrefixHandle, ScoringEngine
from ..model.engines import twin_backend
from ..model.load import pick_device
from ..model.precision import precision_named
from ..model.store import PrefixStore
from .options import ScoringOptions
from .prepare import Task
from .scorer import Scorer
from .scorer import load_engine as scorer_engine

log = logging.getLogger(__name__)


def build_scorer(task: Task, options: ScoringOptions) -> Scorer:
    """The task's scorer, whole: its model loaded, its prefix from the prefix store when kept
    there (else prefilled and kept), pruning decided. With `exact`, a low-precision scorer whose
    close calls a float32 twin scores again (float32 alone on hardware without bfloat16 matrix
    instructions, where that would gain nothing)."""
    from .exact import TWIN_WHY, CheckedScorer

    why = exact_refusal(task.spec, options.backend, options.dtype) if options.exact else None
    if why:  # the command line asked before: the Python API's caller hears it here
        raise UsageError(why)
    store = prefix_store(options)
    device = pick_device(options.device)
    if options.exact and not precision_named(options.dtype).pays(device):
        log.warning("this %s has no %s matrix instructions, so --exact would gain nothing: scoring in float32",
                    device, options.dtype)
        scorer: Scorer = Scorer.load(task, options.cache_dir, options.device, "float32", store,
                                         says_precision=True, backend=twin_backend().name, why=TWIN_WHY)
    elif options.exact:
        scorer = CheckedScorer.pair(task, options.cache_dir, options.device, options.dtype, store)
    else:
        scorer = Scorer.load(task, options.cache_dir, options.device, options.dtype, store,
                             backend=options.backend, threads=options.threads, prompt_scores=options.prompt_scores)
    scorer.prune(options.prune, options.exact)
    return scorer


def load_engine(task: Task, options: ScoringOptions) -> ScoringEngine:
    """The task's model, loaded on the options' device and precision, as an engine (for
    `build_on`: one model for several tasks)."""
    return scorer_engine(task, options.cache_dir, options.device, options.dtype, options.backend, options.threads)


def build_on(task: Task, engine: ScoringEngine, options: ScoringOptions, prefix: PrefixHandle | None = None) -> Scorer:
    """The task's scorer on a model already loaded (several tasks of one model: `tune`'s
    variants, `Classifier`'s zero-shot label sets, the server's question packs), its prefix as
    `build_scorer` gets it, or `prefix` when the caller holds it already (prefilled for this
    task's prefix ids)."""
    scorer = Scorer(task, engine, prefix, prompt_scores=options.prompt_scores) if prefix is not None else \
        Scorer.on(task, engine, prefix_store(options), prompt_scores=options.prompt_scores)
    scorer.prune(options.prune, options.exact)
    return scorer


def prefix_store(options: ScoringOptions) -> PrefixStore | None:
    """The prefix store the options ask for (None: --no-cache-store)."""
    if not options.cache_store:
        return None
    root = prefixes_dir(options.cache_dir)
    return PrefixStore(root) if options.store_max_bytes is None else PrefixStore(root, options.store_max_bytes)
