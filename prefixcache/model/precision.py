"""The precisions the transformers engine computes in, one registry entry each: the dtype its weights
load in, how they are quantised, the packages whose versions join the engine's, whether an item's
scores move with the items batched beside it, the matrix unit that makes it pay and how to tell
whether a device has it, and the tolerance of the shared-prefix path against a naive forward. The
rest of the program asks the entry, never tests a precision's name.

Adding a precision (int4, fp8) is one `register(Precision(...))` line, and a quantiser where its
weights are not a torch dtype.

Example:
    entry = precision_named("int8")
    entry.loads_as                  # "float32": loaded, then quantised
    entry.pays("cpu")               # whether this CPU has int8 dot products
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .. import compat
from ..errors import UsageError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _int8_quantise(model: "PreTrainedModel") -> int:
    from .int8 import quantise

    return quantise(model)


def _int8_layers() -> Any:
    from .int8 import LayerQuantiser

    return LayerQuantiser()


def _int8_installed() -> bool:
    from .int8 import installed

    return installed()


@dataclass(frozen=True)
class Precision:
    """One precision as the registry knows it.

    Attributes:
        name: what `--dtype`, records and fingerprints call it.
        loads_as: the torch dtype (by name) its weights load in.
        low: below float32: `--exact` scores its close calls again in float32.
        moves_with_batch: an item's scores move with the items batched beside it (padding and
            kernel blocking round differently; int8 crosses a quantisation step): the batch
            options are part of what reproduces a run.
        packages: the packages computing beside transformers at it (their versions join the
            engine's in a record's identity).
        unit: the matrix unit that makes it pay, in words (None: float32's, on every device).
        has_unit: whether a device ("cpu", "cuda:0") has that unit.
        tolerance: the most the shared-prefix path may differ from a naive forward in the same
            precision, in log-probability (the first batch of an unchecked architecture), plus
            `relative` times the log-probability's magnitude (rounding grows with it: a unit in
            the last place of bfloat16 is 1/128 of the value).
        quantise: replaces a loaded model's weights in place (None: the load's dtype is all).
        layers: a quantiser of one layer at a time, called as the layer loads (its `finish(model)`
            says whether it quantised the model; else `quantise` runs after the load).
        installed: whether what quantises it can be imported; install: how to get it.
        peak_unit: what its matrix peak is counted in ("GFLOP" or "GOP").
    """

    name: str
    loads_as: str
    low: bool = True
    moves_with_batch: bool = True
    packages: tuple[str, ...] = ()
    unit: str | None = None
    has_unit: Callable[[str], bool] = lambda device: True
    tolerance: float = 5e-2
    relative: float = 0.0
    quantise: Callable[[Any], int] | None = None
    layers: Callable[[], Any] | None = None
    installed: Callable[[], bool] = lambda: True
    install: str = ""
    peak_unit: str = "GFLOP"

    def pays(self, device: str) -> bool:
        """Whether `device` has the matrix unit that makes this precision faster than float32."""
        return self.has_unit(device)


_REGISTRY: dict[str, Precision] = {}


def register(precision: Precision) -> Precision:
    """Add a precision; a name taken already is refused (ValueError)."""
    if precision.name in _REGISTRY:
        raise ValueError(f"a precision named {precision.name!r} is registered already")
    _REGISTRY[precision.name] = precision
    return precision


def names() -> tuple[str, ...]:
    """Every precision's name, float32 first."""
    return tuple(_REGISTRY)


def low_names() -> tuple[str, ...]:
    """The precisions `--exact` checks against float32."""
    return tuple(name for name, p in _REGISTRY.items() if p.low)


def precision_named(name: str) -> Precision:
    """The registry's entry; UsageError naming the choices for an unknown one."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; use auto, {', '.join(names()[:-1])} or {names()[-1]}") from None


def find(name: str) -> Precision | None:
    """The entry for a precision in words, or None (a GGUF file's own types on llama.cpp)."""
    return _REGISTRY.get(name)


register(Precision("float32", "float32", low=False, moves_with_batch=False, tolerance=1e-3))
register(Precision("bfloat16", "bfloat16", unit="bfloat16 matrix instructions (AVX-512 BF16 or AMX)",
                   has_unit=lambda device: compat.bf16_matmul(device), relative=2**-7))
register(Precision("float16", "float16", unit="bfloat16 matrix instructions (AVX-512 BF16 or AMX)",
                   has_unit=lambda device: compat.bf16_matmul(device), relative=2**-10))
# int8 moves a value by a whole step where a last-bit difference crosses one (up to ~0.8 nats measured)
register(Precision("int8", "float32", packages=("torchao",),
                   unit="int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX)",
                   has_unit=lambda device: compat.int8_matmul(device), tolerance=1.0, quantise=_int8_quantise,
                   layers=_int8_layers,
                   installed=_int8_installed, install="torchao: pip install 'prefixcache[int8]' (torchao)",
                   peak_unit="GOP"))
