"""The engines a model can run on, one registry entry each: its name, why it cannot run a model as
asked, the memory it will take, how it loads, and what it can do (its capabilities), all known
before anything loads. The rest of the program asks the entry, never tests an engine's name.

Adding an engine is one module implementing the engine protocol (model/protocol.py) and one
`register(Backend(...))` line.

Example:
    backend = backend_named("llama.cpp")
    why = backend.refusal(source, device="cpu", dtype="auto", exact=False)   # None: it can
    engine = open_engine(backend, Load(source, tokenizer, cache_dir, prefix_tokens=145))
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ModelError, UsageError
from .llamacpp import MAX_SEQUENCES
from .load import ModelSource
from .memory import GB, Footprint, available_and_why

log = logging.getLogger(__name__)
NO_CHECK = "PREFIXCACHE_NO_MEMORY_CHECK"  # set to 1: load a model whatever its estimate says


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
        t = trie(list(candidates))
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


def open_engine(backend: Backend, load: Load) -> Any:
    """The engine loaded: its limits checked and its memory said first, a model that would not
    fit refused before it loads (`fits`)."""
    if load.candidates:
        backend.check_candidates(load.candidates)
    need, device = backend.footprint(load)
    fits(load.source, need, device, backend)
    return backend.make(load)


def fits(source: ModelSource, need: Footprint | None, device: str, backend: Backend | None = None,
         say: bool = True) -> None:
    """Say (log; not with `say` false) the memory the model will take, `need`, estimated from its
    files alone; raise ModelError, before anything is loaded, when that is more than the device
    has available."""
    if need is None:
        return
    if say:
        log.info("memory: %s will take %s", source.ref, need.words())
    free, bound = available_and_why() if device == "cpu" else (_accelerator_free(device), "this machine")
    if free is not None and need.total > free and os.environ.get(NO_CHECK) != "1":
        raise ModelError(f"{source.ref} needs {need.words()}, and {bound} has {free / GB:.2f} GB available "
                         f"on {device}: free some memory, or use a smaller model or quantisation (-m)"
                         f"{_smaller(source, backend)}; {NO_CHECK}=1 loads it anyway")


def _smaller(source: ModelSource, backend: Backend | None) -> str:
    """Another engine that keeps a GGUF file quantised, where this one would not."""
    if source.kind != "gguf" or (backend is not None and backend.file_precision):
        return ""
    other = quantised_backend()
    return f", or --backend {other.name} to keep it quantised" if other else ""


def _accelerator_free(device: str) -> int | None:
    import torch

    try:
        return int(torch.cuda.mem_get_info(torch.device(device))[0]) if device.startswith("cuda") else None
    except Exception:  # noqa: BLE001 - no figure: no check
        return None


# -- the two engines -------------------------------------------------------------------------------
def _transformers_footprint(load: Load) -> tuple[Footprint | None, str]:
    from .load import pick_device, pick_dtype
    from .memory import footprint

    device = pick_device(load.device)
    itemsize = pick_dtype(load.dtype, device).itemsize
    return footprint(load.source, load.cache_dir, itemsize, load.prefix_tokens + load.batch_tokens), device


def _transformers_make(load: Load) -> Any:
    import torch

    from .engine import Engine
    from .load import dtype_name, load_model, pick_device, pick_dtype
    from .precision import precision_named

    if load.threads:
        torch.set_num_threads(load.threads)
    device = pick_device(load.device)
    precision = precision_named(dtype_name(load.dtype, device))
    _slow_precision(precision, device)
    layers = precision.layers() if precision.layers is not None and device == "cpu" else None  # each as it loads
    model = load_model(load.source, load.tokenizer, load.cache_dir, device, pick_dtype(load.dtype, device), layers)
    if precision.quantise is not None and not (layers is not None and layers.finish(model)):
        precision.quantise(model)
    return Engine(model)


def _slow_precision(precision: Any, device: str) -> None:
    """Warn where a low precision asked for is slower than float32: a CPU without its matrix unit
    emulates it (measured: bfloat16 6.3x slower than float32 without bfloat16 instructions; int8
    gains little without int8 dot products)."""
    if device != "cpu" or precision.pays(device):
        return
    if precision.quantise is None:
        log.warning("--dtype %s: this CPU has no %s, so it computes several times slower than float32 (measured "
                    "6.3x); --dtype float32 (or auto) is faster and exact", precision.name, precision.unit)
    else:
        log.warning("--dtype %s: this CPU has no %s, so %s may be no faster than float32; bench times both",
                    precision.name, precision.unit, precision.name)


def _transformers_refusal(source: ModelSource, device: str, dtype: str, exact: bool) -> str | None:
    from .precision import find

    precision = find(dtype)
    if precision is None or precision.quantise is None:
        return None
    if not precision.installed():
        return f"--dtype {dtype} needs {precision.install}"
    if device not in ("auto", "cpu", None) and not str(device).startswith("cuda"):
        return f"--dtype {dtype} runs on the CPU or CUDA, not {device}"
    return None


def _precision_moves(precision: str) -> bool:
    from .precision import find

    entry = find(precision)
    return entry is None or entry.moves_with_batch


def _precision_packages(precision: str) -> tuple[str, ...]:
    from .precision import find

    entry = find(precision)
    return entry.packages if entry is not None else ()


def _llama_gpu(device: str) -> bool:
    from .llamacpp import gpu_build

    return device not in ("cpu",) and gpu_build()


def _llama_footprint(load: Load) -> tuple[Footprint | None, str]:
    """What llama.cpp will take, its compute buffers as measured with UBATCH_TOKENS micro-batches
    (a whole decode as one micro-batch measured 20-50 MB more resident: within the estimate)."""
    from .llamacpp import UBATCH_TOKENS

    return _llama_need(load, UBATCH_TOKENS), "cuda" if _llama_gpu(load.device) else "cpu"


def _llama_need(load: Load, ubatch: int) -> Footprint | None:
    """llama.cpp's memory estimate for the task's prefix with micro-batches of `ubatch` tokens."""
    from .llamacpp import context_cells, kv_bytes
    from .memory import llama_footprint

    path = Path(load.source.path)
    return llama_footprint(path, context_cells(load.prefix_tokens), ubatch, kv_bytes(path))


def _llama_ubatch(load: Load) -> int:
    """The micro-batch llama.cpp runs: a whole decode at once where even the estimate's worst case
    for it (buffers reserved for every token of a full decode) fits what the CPU has available,
    else UBATCH_TOKENS."""
    from .llamacpp import DECODE_TOKENS, UBATCH_TOKENS

    whole = _llama_need(load, DECODE_TOKENS)
    free = None if _llama_gpu(load.device) else available_and_why()[0]
    if whole is None or free is None or whole.total <= free:
        return DECODE_TOKENS
    log.info("llama.cpp decodes in %d-token micro-batches: a whole decode's buffers could take %.2f GB",
             UBATCH_TOKENS, whole.total / GB)
    return UBATCH_TOKENS


def _llama_make(load: Load) -> Any:
    from .cache import checks_dir
    from .llamacpp import GPU_LAYERS, LlamaEngine
    from .llamaprobe import probe

    path = Path(load.source.path)
    probe(path, checks_dir(load.cache_dir))
    ubatch = _llama_ubatch(load)
    return LlamaEngine(path, load.threads, gpu_layers=GPU_LAYERS if _llama_gpu(load.device) else 0, ubatch=ubatch)


def _llama_refusal(source: ModelSource, device: str, dtype: str, exact: bool) -> str | None:
    from .llamacpp import INSTALL, gpu_build, installed

    if source.kind != "gguf":
        return f"llama.cpp reads GGUF files, and {source.ref} is not one (-m FILE.gguf)"
    if not installed():
        return f"llama-cpp-python is not installed: {INSTALL}"
    if exact:
        return "--exact scores close calls again in float32 on transformers; llama.cpp has no float32 twin of a file"
    if dtype not in ("auto", None):
        return f"--dtype {dtype}: llama.cpp computes in the GGUF file's own types (transformers runs --dtype)"
    if device not in ("auto", "cpu", None) and not gpu_build():
        return f"--device {device}: this llama.cpp was built for the CPU only (docs/models.md: a GPU build)"
    return None


register(Backend("transformers", "transformers", _transformers_make, refusal=_transformers_refusal,
                 footprint=_transformers_footprint, float32_twin=True,
                 moves_with_batch=_precision_moves, computes_with=_precision_packages,
                 summary="any model; a GGUF file is dequantised to float once"))
register(Backend("llama.cpp", "llama_cpp_python", _llama_make, refusal=_llama_refusal, footprint=_llama_footprint,
                 file_precision=True, max_leaves=MAX_SEQUENCES - 1, moves_with_batch=lambda precision: True,
                 summary="a GGUF file kept quantised: needs the llama extra"))
