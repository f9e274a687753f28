"""`ScoringOptions`: what every entry point may choose about scoring, without torch (the command
line reads and checks them before any model loads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..model.cache import cache_root, store_max_bytes

BATCH_SIZE = 64  # items in one forward pass at most (--batch-size, `Batching`, the Python API)
BATCH_TOKENS = 768  # about this many tokens through the model in one pass (--batch-tokens)


@dataclass(frozen=True)
class ScoringOptions:
    """What an entry point may choose about scoring; `run`'s options carry the same values.

    Attributes:
        cache_dir: converted models and stored prefixes.
        device, dtype: "auto" (CUDA when present, float32 on the CPU) or a name.
        exact: --exact: low precision with close calls scored again in float32.
        prune: "auto", "on", "exact" or "off" (--prune).
        cache_store: keep and reuse prefilled prefixes in the prefix store.
        store_max_bytes: the prefix store's bound (None: its default).
        backend: "transformers", "llama.cpp" or "auto" (model/choice.py); None: the spec's, else auto.
        threads: CPU threads the model computes with (None: every core).
        prompt_scores: with a fitted head, score the options too (their log-probabilities in the
            records); without it a head of the state alone answers alone.
    """

    cache_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    exact: bool = False
    prune: str = "auto"
    cache_store: bool = True
    store_max_bytes: Optional[int] = None
    backend: Optional[str] = None
    threads: Optional[int] = None
    prompt_scores: bool = False

    @classmethod
    def from_environment(cls, cache_dir: Union[str, Path, None] = None, **given: Any) -> "ScoringOptions":
        """Options as the command line reads them: `cache_dir` (else PREFIXCACHE_CACHE_DIR, else
        ~/.cache/prefixcache) and PREFIXCACHE_STORE_MAX_MB, with `given` set over them."""
        given.setdefault("store_max_bytes", store_max_bytes())
        return cls(cache_root(cache_dir), **given)

    def replace(self, **changes: Any) -> "ScoringOptions":
        return dataclasses.replace(self, **changes)


def exact_refusal(spec: Any, backend: Optional[str], dtype: Optional[str]) -> Optional[str]:
    """Why `--exact` cannot run for `spec` with the engine and precision asked, in one line; None
    where it can. The one place its eligibility is decided: the command line before any model
    loads, and the scorer's build (the Python API) ask it alike."""
    from ..model.engines import backend_named, twin_backend
    from ..model.precision import low_names
    from ..task.head import exact_refusal as head_refusal

    if spec.head is not None:
        return head_refusal(spec.head)
    asked = backend or spec.backend
    if asked not in (None, "auto") and not backend_named(asked).float32_twin:
        twin = twin_backend().name
        return (f"--backend {asked}: --exact scores close calls again in float32 on {twin}; {asked} has no float32 "
                f"twin of a file (drop --exact, or use --backend {twin} --dtype bfloat16)")
    if dtype not in low_names():
        return ("--exact re-scores the close calls of a bfloat16, float16 or int8 run in float32: give --dtype "
                "bfloat16 (or int8, float16)")
    return None
