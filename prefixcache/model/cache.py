"""The cache's layout, in one place: where it is and what lives under it.

    <cache>/models/<key>/    converted (dequantised GGUF) models, one folder each (load.py)
    <cache>/prefixes/        prefilled prefixes and the cache's signing secret (store.py)
    <cache>/states/<key>/    the hidden states `fit` read from labelled items, a folder a fit (labelled/states.py)

The cache is `--cache-dir` or `cache_dir=`, else PREFIXCACHE_CACHE_DIR, else
$XDG_CACHE_HOME/prefixcache (~/.cache/prefixcache); PREFIXCACHE_STORE_MAX_MB bounds the prefix
store. Every entry point (the command line, `Classifier`, Ray, `tune`) reads them here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional, Union

from ..errors import UsageError

CACHE_ENV, STORE_MAX_ENV = "PREFIXCACHE_CACHE_DIR", "PREFIXCACHE_STORE_MAX_MB"


def default_cache_dir() -> Path:
    """Where converted models and prefilled prefixes are kept unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixcache"


def cache_root(given: Union[str, os.PathLike, None] = None) -> Path:
    """The cache: `given`, else PREFIXCACHE_CACHE_DIR, else the default."""
    chosen = given or os.environ.get(CACHE_ENV)
    return Path(chosen).expanduser() if chosen else default_cache_dir()


def models_dir(cache_dir: Union[str, os.PathLike]) -> Path:
    """Converted (dequantised GGUF) models, one folder each."""
    return Path(cache_dir) / "models"


def prefixes_dir(cache_dir: Union[str, os.PathLike]) -> Path:
    """Prefilled prefixes (the prefix store) and the cache's signing secret."""
    return Path(cache_dir) / "prefixes"


def checks_dir(cache_dir: Union[str, os.PathLike]) -> Path:
    """Marks of checks done once per build: llama.cpp's probe of its kernels on this CPU."""
    return Path(cache_dir) / "checks"


def states_dir(cache_dir: Union[str, os.PathLike]) -> Path:
    """The states `fit` read, kept so that an interrupted fit continues and a refit is free."""
    return Path(cache_dir) / "states"


def store_max_bytes() -> Optional[int]:
    """PREFIXCACHE_STORE_MAX_MB as bytes: the prefix store's bound (None: unset, its default)."""
    limit = os.environ.get(STORE_MAX_ENV)
    if not limit:
        return None
    try:
        megabytes = float(limit)
    except ValueError:
        megabytes = float("nan")
    if not math.isfinite(megabytes) or megabytes < 0:
        raise UsageError(f"{STORE_MAX_ENV} must be a number of megabytes (0 or more), not {limit!r}")
    return int(megabytes * 2**20)
