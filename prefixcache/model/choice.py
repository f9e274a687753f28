"""Which engine runs a model: transformers (any model, dequantising a GGUF file to float once) or
llama.cpp (a GGUF file as it is, quantised). `pick_engine` decides from the model reference and
what was asked, before anything loads, and says in one line why a choice cannot be had.

`auto` picks llama.cpp for a GGUF file when llama-cpp-python is installed and its weights as a
float32 copy would take AUTO_FLOAT32_BYTES or more: measured here (docs/performance.md), the
transformers engine is the faster one for a 135M model (batched float32 on a CPU outruns
quantised matrix products at that size) and llama.cpp the faster, and the one that fits, from
about a billion parameters on. Anything else asked of auto (a device llama.cpp was not built for,
--dtype, --exact) keeps transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .llamacpp import installed
from .load import ModelSource

ENGINES = ("auto", "transformers", "llama.cpp")
AUTO_FLOAT32_BYTES = 4_000_000_000  # a GGUF model whose float32 copy is this big or bigger runs on llama.cpp
INSTALL = ("pip install 'prefixcache[llama]' (llama-cpp-python builds llama.cpp from source; docs/models.md says "
           "how to build it for your CPU or GPU)")


ASKED = "asked for: --backend, PREFIXCACHE_BACKEND or the spec's 'backend'"


@dataclass(frozen=True)
class Picked:
    """The engine chosen (`name`) and why (said in the run's log)."""

    name: str
    why: str = ""


def pick_engine(source: ModelSource, asked: str | None, device: str = "auto", dtype: str = "auto",
                exact: bool = False, float32_bytes: int | None = None) -> Picked:
    """The engine for `source` given `asked` ("auto", "transformers", "llama.cpp"; None: auto),
    the device, dtype and --exact asked; `float32_bytes`: the model's weights as float32 (None:
    not known). Raises UsageError when `asked` cannot be had, saying what can."""
    asked = asked or "auto"
    if asked not in ENGINES:
        raise UsageError(f"unknown backend {asked!r}: choose one of {', '.join(ENGINES)}")
    if asked == "transformers":
        return Picked("transformers", ASKED)
    if asked == "auto" and source.kind != "gguf":
        return Picked("transformers", "not a GGUF file")
    refusal = _llama_refusal(source, device, dtype, exact)
    if asked == "llama.cpp":
        if refusal:
            raise UsageError(f"--backend llama.cpp: {refusal}")
        return Picked("llama.cpp", ASKED)
    if refusal:
        return Picked("transformers", refusal)
    if float32_bytes is None or float32_bytes < AUTO_FLOAT32_BYTES:
        size = "of unknown size" if float32_bytes is None else f"{float32_bytes / 1e9:.1f} GB as float32"
        return Picked("transformers", f"a GGUF model {size} runs faster dequantised (llama.cpp from "
                                      f"{AUTO_FLOAT32_BYTES / 1e9:.0f} GB; --backend llama.cpp keeps it quantised)")
    return Picked("llama.cpp", f"its float32 copy would take {float32_bytes / 1e9:.1f} GB: kept quantised on llama.cpp")


def _llama_refusal(source: ModelSource, device: str, dtype: str, exact: bool) -> str | None:
    """Why llama.cpp cannot run `source` as asked, or None."""
    if source.kind != "gguf":
        return f"llama.cpp reads GGUF files, and {source.ref} is not one (-m FILE.gguf)"
    if not installed():
        return f"llama-cpp-python is not installed: {INSTALL}"
    if exact:
        return "--exact scores close calls again in float32 on transformers; llama.cpp has no float32 twin of a file"
    if dtype not in ("auto", None):
        return f"--dtype {dtype}: llama.cpp computes in the GGUF file's own types"
    if device not in ("auto", "cpu", None) and not gpu_build():
        return f"--device {device}: this llama.cpp was built for the CPU only (docs/models.md: a GPU build)"
    return None


def gpu_build() -> bool:
    """Whether the installed llama.cpp can offload layers to a GPU (CUDA, Metal, Vulkan builds)."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())
