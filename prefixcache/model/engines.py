"""The engines a model can run on, one registry entry each: its name, why it cannot run a model as
asked, the memory it will take, how it loads, and what it can do (its capabilities), all known
before anything loads. The rest of the program asks the entry, never tests an engine's name.

Adding an engine is one module implementing the engine protocol (model/protocol.py), its entry
(a `Backend`, model/backend.py) in a module of its own, and one `register(...)` line here.

Example:
    backend = backend_named("llama.cpp")
    why = backend.refusal(source, device="cpu", dtype="auto", exact=False)   # None: it can
    engine = open_engine(backend, Load(source, tokenizer, cache_dir, prefix_tokens=145))
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import ModelError
from .backend import (Backend, Load, backend_named, default_backend, names, quantised_backend, register,
                      twin_backend, unregister)
from .llamaentry import LLAMA
from .load import ModelSource
from .memory import GB, Footprint, available_and_why
from .transformersentry import TRANSFORMERS

__all__ = ["Backend", "Load", "backend_named", "default_backend", "fits", "names", "open_engine", "quantised_backend",
           "register", "twin_backend", "unregister"]

log = logging.getLogger(__name__)
NO_CHECK = "PREFIXCACHE_NO_MEMORY_CHECK"  # set to 1: load a model whatever its estimate says


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


register(TRANSFORMERS)  # the first registered is the default
register(LLAMA)
