"""`ScoringOptions`: what every entry point may choose about scoring, without torch (the command
line reads and checks them before any model loads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..model.cache import cache_root, store_max_bytes


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
    def from_environment(cls, cache_dir: Union[str, Path, None] = None, **given) -> "ScoringOptions":
        """Options as the command line reads them: `cache_dir` (else PREFIXCACHE_CACHE_DIR, else
        ~/.cache/prefixcache) and PREFIXCACHE_STORE_MAX_MB, with `given` set over them."""
        given.setdefault("store_max_bytes", store_max_bytes())
        return cls(cache_root(cache_dir), **given)

    def replace(self, **changes) -> "ScoringOptions":
        return dataclasses.replace(self, **changes)
