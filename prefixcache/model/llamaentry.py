"""The llama.cpp engine's registry entry: why it refuses a model as asked (not a GGUF file, the
package missing, a dtype or --exact asked of it), the memory it will take, the micro-batch it
decodes in and how it loads (its build checked once on this CPU first).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .backend import Backend, Load
from .llamacpp import MAX_SEQUENCES
from .load import ModelSource
from .memory import GB, Footprint, available_and_why

log = logging.getLogger(__name__)


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


LLAMA = Backend("llama.cpp", "llama_cpp_python", _llama_make, refusal=_llama_refusal, footprint=_llama_footprint,
                file_precision=True, max_leaves=MAX_SEQUENCES - 1, moves_with_batch=lambda precision: True,
                summary="a GGUF file computed in its own types: needs the llama extra")
