"""The transformers engine's registry entry: why it refuses a model as asked (a precision whose
package is missing), the memory it will take, how it loads (the precision's layers quantised as
they load) and what its precisions change in a record's identity.
"""

from __future__ import annotations

import logging
from typing import Any

from .backend import Backend, Load
from .load import ModelSource
from .memory import Footprint

log = logging.getLogger(__name__)


def _transformers_footprint(load: Load) -> tuple[Footprint | None, str]:
    from .load import pick_device, pick_dtype
    from .memory import footprint

    from .load import dtype_name
    from .precision import precision_named

    device = pick_device(load.device)
    itemsize = pick_dtype(load.dtype, device).itemsize
    kept = precision_named(dtype_name(load.dtype, device)).quantise is None  # int8 quantises float32 layers
    return footprint(load.source, load.cache_dir, itemsize, load.prefix_tokens + load.batch_tokens, kept), device


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
    model = load_model(load.source, load.tokenizer, load.cache_dir, device, pick_dtype(load.dtype, device), layers,
                       keep=precision.quantise is None)
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


TRANSFORMERS = Backend("transformers", "transformers", _transformers_make, refusal=_transformers_refusal,
                       footprint=_transformers_footprint, float32_twin=True,
                       moves_with_batch=_precision_moves, computes_with=_precision_packages,
                       summary="any model; a GGUF file kept quantised, each layer expanded as it runs")
