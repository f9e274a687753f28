"""Which engine runs a model (model/engines.py's registry: transformers, which runs any model and
keeps a GGUF file's weights quantised where it reads them that way (model/keptload.py), and
llama.cpp, which runs a GGUF file as it is). `pick_engine` decides from the model reference and
what was asked, before anything loads, and says in one line why a choice cannot be had.

`auto` picks llama.cpp for a GGUF file when it can run it and the weights as a float32 copy would
take AUTO_FLOAT32_BYTES or more (in float32 the transformers engine is the faster one for a 135M
model and llama.cpp from about a billion parameters on), unless the default engine keeps that
file's weights quantised and this CPU computes bfloat16 on a matrix unit: measured
(docs/performance.md), that runs a 1.5B model faster than llama.cpp built for the CPU, in about
the memory llama.cpp takes, and `--dtype auto` gives it float32's labels (--exact). Anything else
asked of auto (a device llama.cpp was not built for, --dtype, --exact) keeps the default engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .engines import backend_named, default_backend, names, quantised_backend
from .load import ModelSource

AUTO_FLOAT32_BYTES = 4_000_000_000  # a GGUF model whose float32 copy is this big or bigger is kept quantised


ASKED = "asked for: --backend, PREFIXCACHE_BACKEND or the spec's 'backend'"


def engines() -> tuple[str, ...]:
    """What --backend and the spec's `backend` accept: auto and every registered engine."""
    return ("auto",) + names()


AUTO_WORDS = ("transformers, but llama.cpp for a GGUF file of about a billion parameters or more when it is "
              "installed and this CPU has no bfloat16 matrix unit")  # what `pick_engine` does with auto, in words
KEPT_SIZE = 1.25  # a GGUF file is run kept when its kept weights take at most this times the file


def engines_words() -> str:
    """Every engine and what it runs, then auto's rule: what --backend's help says."""
    listed = ", ".join(f"{name} ({backend_named(name).summary})" if backend_named(name).summary else name
                       for name in names())
    return f"{listed} or auto: {AUTO_WORDS}"


@dataclass(frozen=True)
class Picked:
    """The engine chosen (`name`) and why (said in the run's log)."""

    name: str
    why: str = ""


def pick_engine(source: ModelSource, asked: str | None, device: str = "auto", dtype: str = "auto",
                exact: bool = False, float32_bytes: int | None = None) -> Picked:
    """The engine for `source` given `asked` (an engine's name or "auto"; None: auto), the device,
    dtype and --exact asked; `float32_bytes`: the model's weights as float32 (None: not known).
    Raises UsageError when `asked` cannot be had, saying what can."""
    asked = asked or "auto"
    if asked != "auto":
        backend = backend_named(asked)
        refusal = backend.refusal(source, device, dtype, exact)
        if refusal:
            raise UsageError(f"--backend {asked}: {refusal}")
        return Picked(asked, ASKED)
    picked = _auto(source, device, dtype, exact, float32_bytes)
    refusal = backend_named(picked.name).refusal(source, device, dtype, exact)
    if refusal:
        raise UsageError(refusal)
    return picked


def _auto(source: ModelSource, device: str, dtype: str, exact: bool, float32_bytes: int | None) -> Picked:
    """auto's choice: the engine that keeps a GGUF file quantised for a model of a billion
    parameters or more, where it can run it as asked; else the default."""
    default = default_backend().name
    if source.kind != "gguf":
        return Picked(default, "not a GGUF file")
    kept = quantised_backend()
    if kept is None:
        return Picked(default, "no engine keeps a GGUF file quantised")
    refusal = kept.refusal(source, device, dtype, exact)
    if refusal:
        return Picked(default, refusal)
    if float32_bytes is None or float32_bytes < AUTO_FLOAT32_BYTES:
        size = "of unknown size" if float32_bytes is None else f"{float32_bytes / 1e9:.1f} GB as float32"
        return Picked(default, f"a GGUF model {size}: expanded from its quantisation, which runs faster below "
                               f"{AUTO_FLOAT32_BYTES / 1e9:.0f} GB; --backend {kept.name} keeps it quantised")
    if _kept_in_bfloat16(source, device, dtype):  # large enough for --dtype auto to mean bfloat16
        return Picked(default, "its weights kept as the file quantises them, computed on this CPU's bfloat16 unit "
                               f"(faster than {kept.name} on the models measured); --backend {kept.name} for the "
                               "file's own types")
    return Picked(kept.name, f"its float32 copy would take {float32_bytes / 1e9:.1f} GB: kept quantised on {kept.name}")


def _kept_in_bfloat16(source: ModelSource, device: str, dtype: str) -> bool:
    """Whether the default engine would run this GGUF file on the CPU in bfloat16 on a matrix unit
    with its weights kept at about the file's size (--dtype auto or bfloat16)."""
    from pathlib import Path

    from .load import pick_device
    from .memory import kept_weight_bytes
    from .precision import precision_named

    if dtype not in ("auto", "bfloat16") or pick_device(device) != "cpu" or not precision_named("bfloat16").pays("cpu"):
        return False
    try:
        kept = kept_weight_bytes(Path(source.path), 2)
        return kept is not None and kept <= KEPT_SIZE * Path(source.path).stat().st_size
    except Exception:  # noqa: BLE001 - a file that cannot be read so is said where it loads
        return False
