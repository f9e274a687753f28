"""A llama.cpp build checked once on this CPU, in a child process: a build whose kernels crash
here (a build tuned to the machine crashed so in its AMX kernels on a CPU that advertises AMX)
stops in one line instead of killing the run."""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelError
from .llamabuild import PORTABLE


PROBE = """
import sys, llama_cpp as L
quiet = L.llama_log_callback(lambda *a: None)
L.llama_log_set(quiet, None)
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx, params.n_batch = 64, 64
ctx = L.llama_init_from_model(model, params)
tokens = (L.llama_token * 16)(*range(16))
batch = L.llama_batch_get_one(tokens, 16)
sys.exit(0 if model and ctx and L.llama_decode(ctx, batch) == 0 else 3)
"""


def probe(path: Path, marks: Path) -> None:
    """Decode a few tokens of the file's model in a child process once per llama.cpp build and file
    type (a mark in `marks` remembers it), so that a build whose kernels crash on this CPU stops in
    one line (ModelError) instead of killing the run: a build tuned to the machine crashed so in its
    AMX kernels on a CPU that advertises AMX."""
    import subprocess
    import sys
    from importlib.metadata import version

    import llama_cpp

    library = Path(llama_cpp.__file__).parent
    built = max((p.stat().st_mtime_ns for p in library.rglob("*.so*")), default=0)
    mark = marks / f"llama-{version('llama_cpp_python')}-{built}-{_file_type_of(path)}.ok"
    if mark.exists():
        return
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, timeout=600)
    if done.returncode < 0 or done.returncode > 3:
        raise ModelError(
            f"llama.cpp crashed decoding {path.name} on this CPU (exit {done.returncode}): its build does not run "
            f"here; reinstall it with portable kernels: CMAKE_ARGS=\"{PORTABLE}\" pip install --force-reinstall "
            f"--no-cache-dir llama-cpp-python (docs/models.md), or use --backend transformers")
    if done.returncode == 0:
        marks.mkdir(parents=True, exist_ok=True)
        mark.touch()


def _file_type_of(path: Path) -> int | None:
    from .memory import gguf_facts

    try:
        return gguf_facts(path).file_type
    except Exception:  # noqa: BLE001 - one probe a file then
        return None
