"""What the engine registry holds: `Load` (what loading an engine is given), `Backend` (one
engine as the registry knows it: its name, refusal, memory, load and capabilities) and the
registry itself. Each engine's entry is made in its own module (transformersentry.py,
llamaentry.py) and registered in engines.py; a test's engine registers its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ModelError, UsageError
from .load import ModelSource
from .memory import Footprint


@dataclass(frozen=True)
class Load:
    """What loading an engine is given: the model, where and how it runs, and what the task will
    ask of it (`prefix_tokens`, `batch_tokens`: the keys and values it keeps; `candidates`: every
    item's candidates when they are the same for all, so limits are checked before loading)."""

    source: ModelSource
    tokenizer: Any
    cache_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    prefix_tokens: int = 0
    batch_tokens: int = 0
    candidates: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class Backend:
    """One engine as the registry knows it.

    Attributes:
        name: what `--backend`, the spec's `backend` and every record call it.
        package: the distribution whose version is part of a record's identity.
        make: the engine loaded (the memory check and limits passed).
        refusal: why it cannot run a model as asked (source, device, dtype, exact), or None.
        footprint: the memory it will take and the device that memory is on, from the files alone.
        float32_twin: it can load a float32 twin of a low-precision model (`--exact`).
        file_precision: it computes in the model file's own types, not a dtype asked for.
        max_leaves: the most candidate leaves (of their token trie) an item may have; None: no limit.
        stores_prefix: its prefilled prefix can be exported and restored (the prefix store).
        moves_with_batch: whether, at a precision (in words), an item's scores move beyond float
            rounding with the items decoded beside it (quantised kernels): said in the fingerprint.
        computes_with: the packages that compute beside it at a precision (in words): their
            versions are part of its own.
    """

    name: str
    package: str
    make: Callable[[Load], Any]
    refusal: Callable[[ModelSource, str, str, bool], str | None] = lambda source, device, dtype, exact: None
    footprint: Callable[[Load], tuple[Footprint | None, str]] = lambda load: (None, "cpu")
    float32_twin: bool = False
    reads_states: bool = True  # gives hidden states (`score_with_states`): what fitted heads, fit and suggest read
    file_precision: bool = False
    max_leaves: int | None = None
    stores_prefix: bool = True
    moves_with_batch: Callable[[str], bool] = lambda precision: False
    computes_with: Callable[[str], tuple[str, ...]] = lambda precision: ()
    summary: str = ""  # what it runs, in a few words (the --backend help lists each engine's)

    def version(self, precision: str = "") -> str:
        """The installed version of what computes at `precision` (part of an output's identity and
        of a kept prefix's key): its package's, and those computing beside it ("5.25.0; torchao 0.18.0")."""
        from importlib.metadata import PackageNotFoundError, version

        def of(package: str) -> str:
            try:
                return version(package)
            except PackageNotFoundError:
                return "unknown"

        return "; ".join([of(self.package)] + [f"{p} {of(p)}" for p in self.computes_with(precision)])

    def precision(self, dtype_words: str) -> str:
        """What records say it computes in, given the dtype a run resolved (`dtype_words`)."""
        return "the GGUF file's own types" if self.file_precision else dtype_words

    def check_candidates(self, candidates: Sequence[Sequence[int]]) -> None:
        """Refuse (ModelError), before the model loads, candidates beyond `max_leaves`."""
        from .rows import trie

        if self.max_leaves is None or not candidates:
            return
        t = trie([tuple(c) for c in candidates])
        leaves = len(t) - len(set(t.parents) - {-1})
        if leaves > self.max_leaves:
            raise ModelError(f"the spec's candidates need {leaves} {self.name} sequences an item, more than its "
                             f"{self.max_leaves}: use fewer labels or options, or --backend {default_backend().name}")


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add an engine; the first registered is the default. A name taken already is refused
    (ValueError): two modules claiming one name is a mistake, never a replacement (`unregister`
    first to replace one)."""
    if backend.name in _REGISTRY:
        raise ValueError(f"an engine named {backend.name!r} is registered already")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove an engine (a test's toy engine)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every engine's name, the default first."""
    return tuple(_REGISTRY)


def default_backend() -> Backend:
    return next(iter(_REGISTRY.values()))


def backend_named(name: str) -> Backend:
    """The registry's entry; UsageError naming the choices for an unknown one."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}: choose one of {', '.join(('auto',) + names())}") from None


def twin_backend() -> Backend:
    """The engine that loads a float32 twin (`--exact` runs on it)."""
    return next(b for b in _REGISTRY.values() if b.float32_twin)


def quantised_backend() -> Backend | None:
    """The engine that runs a GGUF file at its own quantisation (what `auto` keeps a large one on)."""
    return next((b for b in _REGISTRY.values() if b.file_precision), None)
